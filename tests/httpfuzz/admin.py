"""Admin-side fuzz: the paths probed and PATCH /admin/policy documents, mostly numbers in the fields each
section takes."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from tests.httpfuzz.strategies import ANY_JSON, FINITE, HOSTILE_TEXT, INTS, TEXT

ADMIN_PATHS = st.sampled_from(["/admin/policy", "/admin/workers", "/admin/tiers", "/v1/models", "/health", "/ready",
                               "/metrics", "/v1/responses", "/v1/embeddings", "/admin", "/admin/", "/",
                               "/admin/conversations/", "/v1/chat/completions"])
COST_FIELDS = ["p0_ms", "p1_ms", "p2_ms", "p_attn_ms", "decode_ms", "decode_ms_per_request", "decode_u1_ms",
               "decode_u2_ms", "kv_capacity_tokens", "token_budget", "affinity_bonus_ms", "affinity_cache_fraction",
               "externality_weight", "backlog_weight", "load_epsilon", "kv_bytes_per_token", "cpu_load_gbps",
               "remote_load_gbps", "remote_rtt_ms", "reservation_weight"]
WAIT_FIELDS = ["quantile", "window", "min_samples", "prior_s", "tool_priors_s", "reserve_max_s", "deadline_factor",
               "prefetch_lead_s", "max_keys"]
PREFILL_FIELDS = ["enabled", "min_gain_tokens", "min_continue", "prior_continue", "prior_stop", "settle_s",
                  "bucket_weight", "max_kv_usage"]
# Mostly numbers (what the fields take), so a fair share of patches is accepted and what they set can be
# checked; wrong types, strings pydantic reads as numbers, maps and unknown fields come from the rest and
# from the mutations.
POLICY_VALUE = (st.floats(0, 50) | st.integers(0, 1000) | st.floats(-1e12, 1e12) | INTS | FINITE
                | st.sampled_from(["Infinity", "-inf", "NaN", "1e300", "-1e9", "1e7", "10000001", "2"])
                | st.booleans() | TEXT | st.dictionaries(TEXT, FINITE | INTS, max_size=3))
WAIT_VALUE = POLICY_VALUE | st.dictionaries(st.sampled_from(["grep", "bash"]) | TEXT, FINITE | INTS, max_size=3)


def section(fields: list[str], values: st.SearchStrategy[Any]) -> st.SearchStrategy[dict[str, Any]]:
    return st.dictionaries(st.sampled_from(fields), values, min_size=1, max_size=3)


SECTIONS = {"cost": section(COST_FIELDS, POLICY_VALUE), "waits": section(WAIT_FIELDS, WAIT_VALUE),
            "prefill": section(PREFILL_FIELDS, POLICY_VALUE)}
POLICY_PATCH = st.sampled_from(sorted(SECTIONS)).flatmap(lambda first: st.fixed_dictionaries(
    {first: SECTIONS[first]}, optional={**{k: v for k, v in SECTIONS.items() if k != first},
                                        "reason": HOSTILE_TEXT | ANY_JSON}))
