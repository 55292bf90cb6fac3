"""The gateway's Prometheus metrics, in a registry owned by one app instance (no globals).

Label names follow vLLM's own series (``model_name``), so PromQL joins gateway and engine series
without ``label_replace``. Tenant ids are chosen by clients, so every ``tenant`` label value goes
through ``TenantLabels``: the heaviest tenants keep their name, the rest share ``(other)``. The request
path records through the methods under "recording" (one per quantity) and touches no metric directly
for the agent quantities. What each series means and what to do when it moves: docs/operations.md.
"""

from __future__ import annotations

import bisect
import json
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from kvgate.gateway.cardinality import ActiveConversations, TenantLabels
from kvgate.router.index import PrefixIndex, Tier
from kvgate.router.kvevents import EventStats
from kvgate.router.types import WorkerId

# vLLM 0.32's own bucket bounds (vllm/v1/metrics/buckets.py), so gateway and engine histograms of the
# same quantity compare bucket for bucket.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
CONTEXT_BUCKETS = tuple(float(2 ** k) for k in range(8, 21))  # 256 .. 1M tokens
KV_BYTES_BUCKETS = tuple(float(4 ** k) for k in range(8, 19))  # 64 KiB .. 64 GiB

STATUS_CLIENT_CLOSED = "499"
"""A client that went away before its response ended (nginx's code; the worker's request was aborted)."""
STATUS_STREAM_BROKEN = "502"
"""A stream whose worker failed after the first byte (the client got 200 and then an error event)."""

_DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2, "float8": 1, "fp8": 1}


def kv_bytes_per_token(model_dir: str | Path) -> int | None:
    """KV cache bytes one token takes in the engine, from the model's ``config.json`` (HF layout): K and V
    per layer and KV head, or one latent vector per layer for MLA (DeepSeek). Assumes the KV cache holds
    the model's dtype (vLLM ``--kv-cache-dtype auto``); None when the directory has no usable config."""
    try:
        cfg: Any = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if isinstance(cfg, dict) and isinstance(cfg.get("text_config"), dict):
        cfg = {**cfg, **cfg["text_config"]}  # multimodal wrappers keep the language model's geometry there
    if not isinstance(cfg, dict):
        return None
    dtype = _DTYPE_BYTES.get(str(cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16").removeprefix("torch."), 2)
    try:
        layers = int(cfg["num_hidden_layers"])
        if cfg.get("kv_lora_rank"):
            per_layer = int(cfg["kv_lora_rank"]) + int(cfg.get("qk_rope_head_dim") or 0)
        else:
            heads = int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"])
            head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // int(cfg["num_attention_heads"]))
            per_layer = 2 * heads * head_dim
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None
    return layers * per_layer * dtype if layers > 0 and per_layer > 0 else None


class _Cells:
    """One label value's bucket counts (not cumulative; the last is +Inf) and sum."""

    __slots__ = ("counts", "total")

    def __init__(self, n: int) -> None:
        self.counts = [0] * n
        self.total = 0.0


class EventHistogram(Collector):
    """A histogram for per-event observations: an observation is a bisect and two additions (about 0.3 us
    against 2.5 us for prometheus_client's, which takes a lock and walks the buckets). Lock-free because
    the relay and the scrape both run on the event loop."""

    def __init__(self, name: str, doc: str, label: str, buckets: tuple[float, ...]) -> None:
        self.name, self.doc, self.label = name, doc, label
        self.bounds = list(buckets)
        self._cells: dict[str, _Cells] = {}

    def cells(self, value: str) -> _Cells:
        c = self._cells.get(value)
        if c is None:
            c = self._cells[value] = _Cells(len(self.bounds) + 1)
        return c

    def collect(self) -> Iterator[Metric]:
        h = HistogramMetricFamily(self.name, self.doc, labels=[self.label])
        for value, c in sorted(self._cells.items()):
            cum, buckets = 0, []
            for le, n in zip([*map(repr, self.bounds), "+Inf"], c.counts, strict=True):
                cum += n
                buckets.append((le, cum))
            h.add_metric([value], buckets, c.total)
        yield h


@dataclass(slots=True)
class DecodeTiming:
    """One stream's output timing: a clock read and an EventHistogram observation per relayed event, no
    JSON. An event is one engine step's output for the request, as vLLM's own ITL counts it."""

    first: float
    last: float
    events: int
    _itl: _Cells
    _bounds: list[float]

    def token(self, now: float) -> None:
        gap = now - self.last
        self._itl.counts[bisect.bisect_left(self._bounds, gap)] += 1
        self._itl.total += gap
        self.last = now
        self.events += 1


def tpot_of(timing: DecodeTiming | None, completion_tokens: int) -> float | None:
    """A stream's time per output token: (last output - first output) / (completion tokens - 1); None
    without decode timing (a non-streamed answer, one event carrying the whole output)."""
    if timing is None or timing.events <= 0 or completion_tokens <= 1:
        return None
    return (timing.last - timing.first) / (completion_tokens - 1)


class GatewayMetrics:
    def __init__(self, model_dirs: Mapping[str, str] | None = None, top_tenants: int = 10,
                 now: Callable[[], float] = time.monotonic) -> None:
        r = self.registry = CollectorRegistry()
        self._now = now
        self.tenants = TenantLabels(top_tenants)
        self._tenant_series: set[tuple[str, str]] = set()
        self.kv_bytes_per_token = {m: b for m, d in (model_dirs or {}).items()
                                   if (b := kv_bytes_per_token(d)) is not None}
        self.active = ActiveConversations()
        self._define_agent_metrics(r)
        self._define_request_metrics(r)
        self._define_routing_metrics(r)
        r.register(_ActiveCollector(self.active, now))

    def _define_agent_metrics(self, r: CollectorRegistry) -> None:
        """The seven quantities to watch instead of the hit rate (docs/operations.md)."""
        mt = ["model_name", "tenant"]
        self.cached_input = Counter("kvgate_cached_input_tokens", "Prompt tokens the worker served from its "
                                    "prefix cache (usage.prompt_tokens_details.cached_tokens).", mt, registry=r)
        self.uncached_prefill = Counter("kvgate_uncached_prefill_tokens", "Prompt tokens the worker prefilled: "
                                        "prompt tokens minus cached tokens.", mt, registry=r)
        self.recomputed_history = Counter(
            "kvgate_recomputed_history_tokens", "History tokens prefilled again because canonicalisation (reasoning "
            "dropped by the policy or the template) made the prompt diverge from the conversation's cached chain.",
            mt, registry=r)
        self.ttft = Histogram("kvgate_ttft_seconds", "Time to first token seen by the gateway (streams).", mt,
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = EventHistogram("kvgate_inter_token_latency_seconds", "Time between consecutive output events "
                                  "of a stream, as relayed.", "model_name", ITL_BUCKETS)
        r.register(self.itl)
        self.tpot = Histogram("kvgate_time_per_output_token_seconds", "Per stream: (last output - first output) / "
                              "(completion tokens - 1).", ["model_name"], buckets=ITL_BUCKETS, registry=r)
        self.active_context = Histogram(
            "kvgate_session_active_context_tokens", "A conversation's context after each completed request: "
            "prompt plus completion tokens, the KV chain it leaves on the worker.", ["model_name"],
            buckets=CONTEXT_BUCKETS, registry=r)
        self.kv_bytes = Histogram("kvgate_session_kv_bytes", "KV bytes that chain takes: active context in whole "
                                  "blocks times the model's KV bytes per token.", ["model_name"],
                                  buckets=KV_BYTES_BUCKETS, registry=r)

    def _define_request_metrics(self, r: CollectorRegistry) -> None:
        self.requests = Counter("kvgate_requests", "Requests answered, by endpoint and status (499: the client "
                                "went away; 502 on a stream: the worker failed after the first byte).",
                                ["endpoint", "status"], registry=r)
        self.upstream_failures = Counter("kvgate_upstream_failures",
                                         "Worker failures seen by the proxy, by worker and kind.",
                                         ["worker", "kind"], registry=r)
        self.retries = Counter("kvgate_retries", "Requests retried on another worker.", registry=r)
        self.client_disconnects = Counter("kvgate_client_disconnects",
                                          "Requests whose client went away (upstream cancelled).", registry=r)
        self.conversation_source = Counter("kvgate_conversation_id_source",
                                           "How each request's conversation was identified.", ["source"],
                                           registry=r)
        self.shed = Counter("kvgate_requests_shed", "Requests refused with 503 overloaded because kvgate's own "
                            "event loop ran later than overload_shed_lag_ms.", registry=r)
        self.regrouped = Counter("kvgate_conversations_regrouped",
                                 "Keyless requests whose derived key named no conversation, found in the one their "
                                 "messages were filed under (a compaction or rewind).", registry=r)
        self.prompt_tokens = Counter("kvgate_prompt_tokens", "Prompt tokens reported by workers.", ["worker"],
                                     registry=r)
        self.cached_tokens = Counter("kvgate_cached_tokens", "Prompt tokens served from the prefix cache.",
                                     ["worker"], registry=r)
        self.completion_tokens = Counter("kvgate_completion_tokens", "Completion tokens reported by workers.",
                                         ["worker"], registry=r)
        self.missing_usage = Counter("kvgate_missing_usage", "Responses that carried no usage.", registry=r)
        self.worker_healthy = Gauge("kvgate_worker_healthy", "1 if the worker is eligible for routing.",
                                    ["worker"], registry=r)
        self.worker_in_flight = Gauge("kvgate_worker_in_flight", "Requests kvgate has in flight per worker.",
                                      ["worker"], registry=r)
        self.session_store_errors = Counter("kvgate_session_store_errors",
                                            "Session store calls that failed (requests were still served).",
                                            registry=r)
        self.routed_prompt_tokens = Counter(
            "kvgate_routed_prompt_tokens", "Prompt tokens kvgate routed on, by where their count came from: the "
            "local tokenizer, a worker's /tokenize, or an estimate (no prefix information).",
            ["model_name", "tokenizer"], registry=r)

    def _define_routing_metrics(self, r: CollectorRegistry) -> None:
        self.route_decisions = Counter("kvgate_route_decisions", "Routing decisions by policy, reason, the tier "
                                       "the reused prefix comes from and whether bounded load left workers out.",
                                       ["policy", "reason", "tier", "bounded"], registry=r)
        self.expected_vs_actual = Histogram(
            "kvgate_expected_vs_actual_cached_tokens",
            "Cached tokens the worker reported minus those the routing decision expected.", ["policy"],
            buckets=(-8192, -2048, -512, -128, -1, 0, 127, 511, 2047, 8191), registry=r)
        self.tokens_lost = Counter("kvgate_prefix_tokens_lost",
                                   "History tokens that could have been reused and were not, by cause.", ["cause"],
                                   registry=r)
        self.restored = Counter("kvgate_history_restored",
                                "Assistant messages restored to their exact form, by what the client changed.",
                                ["field"], registry=r)
        self.expected_cached = Counter("kvgate_expected_cached_tokens",
                                       "Cached tokens the routing decisions expected.", ["policy"], registry=r)
        self.tool_waits = Counter("kvgate_tool_waits", "Tool waits that ended, by outcome against their "
                                  "prediction (within, overrun), and reservations that lapsed or that the fleet "
                                  "store refused over the tenant's parked-KV budget (reservation_refused).",
                                  ["outcome"], registry=r)
        self.wait_plans = Counter("kvgate_wait_plans", "Tool waits by plan: reserve, release, or over_budget (a "
                                  "short wait released because the tenant's parked-KV budget cannot hold it).",
                                  ["action"], registry=r)
        self.retentions = Counter("kvgate_retentions", "Answers whose request asked for its KV to be kept "
                                  "(cache_control, prompt_cache_retention), by outcome: reserve, over_budget (the "
                                  "tenant's parked-KV budget cannot hold it), refused (the fleet store refused it "
                                  "over that budget), lapsed.", ["outcome"], registry=r)
        self.tier_lookups = Counter("kvgate_tier_lookups", "Tier residency lookups, by tier and whether it "
                                    "answered (down: treated as empty).", ["tier", "state"], registry=r)
        self.prefetches = Counter("kvgate_tier_prefetches", "LMCache prefetches asked for.", ["outcome"], registry=r)
        self.prefill_decisions = Counter("kvgate_prefill_decisions", "Background prefill decisions by reason.",
                                         ["reason"], registry=r)
        self.prefills = Counter("kvgate_prefills", "Background prefills: issued, completed, failed, used, wasted.",
                                ["outcome"], registry=r)

    # -- recording: what the request path calls, one method per quantity ---------------------------
    def count_request(self, endpoint: str, status: int | str) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    def count_routed_prompt_tokens(self, model: str, tokenizer: str, tokens: int) -> None:
        self.routed_prompt_tokens.labels(model, tokenizer).inc(tokens)

    def add_cached_input(self, model: str, tenant: str, tokens: int) -> None:
        self.cached_input.labels(model, self._tenant(model, tenant, tokens)).inc(tokens)

    def add_uncached_prefill(self, model: str, tenant: str, tokens: int) -> None:
        self.uncached_prefill.labels(model, self._tenant(model, tenant, tokens)).inc(tokens)

    def add_recomputed_history(self, model: str, tenant: str, tokens: int) -> None:
        self.recomputed_history.labels(model, self._tenant(model, tenant, 0)).inc(tokens)

    def observe_ttft(self, model: str, tenant: str, seconds: float) -> None:
        self.ttft.labels(model, self._tenant(model, tenant, 0)).observe(seconds)

    def decode_timing(self, model: str, first_output_at: float) -> DecodeTiming:
        """Called at a stream's first output; the relay then calls ``token(now)`` on each later event."""
        return DecodeTiming(first_output_at, first_output_at, 0, self.itl.cells(model), self.itl.bounds)

    def observe_tpot(self, model: str, timing: DecodeTiming | None, completion_tokens: int) -> None:
        tpot = tpot_of(timing, completion_tokens)
        if tpot is not None:
            self.tpot.labels(model).observe(tpot)

    def observe_active_context(self, model: str, tokens: int) -> None:
        self.active_context.labels(model).observe(tokens)

    def kv_bytes_of(self, model: str, tokens: int, block_size: int) -> int:
        """The KV ``tokens`` take on a worker: whole blocks times the model's KV bytes per token (0 when
        the model's geometry is unknown)."""
        per_token = self.kv_bytes_per_token.get(model)
        if per_token is None or tokens <= 0:
            return 0
        return -(-tokens // max(1, block_size)) * max(1, block_size) * per_token

    def observe_kv_bytes(self, model: str, tokens: int, block_size: int) -> None:
        n = self.kv_bytes_of(model, tokens, block_size)
        if n:
            self.kv_bytes.labels(model).observe(n)

    def saw_conversation(self, model: str, conversation: str) -> None:
        self.active.add(model, conversation, self._now())

    def _tenant(self, model: str, tenant: str, weight: int) -> str:
        """The tenant's label value; counts its tokens toward the top-N, and removes the series of tenants
        that fell out of it (their later traffic counts under ``(other)``)."""
        for gone in self.tenants.observe(tenant, weight, self._now()):
            for m, t in [p for p in self._tenant_series if p[1] == gone]:
                self._tenant_series.discard((m, t))
                for metric in (self.cached_input, self.uncached_prefill, self.recomputed_history, self.ttft):
                    try:
                        metric.remove(m, t)
                    except KeyError:
                        pass
        label = self.tenants.label(tenant)
        self._tenant_series.add((model, label))
        return label


class _ActiveCollector(Collector):
    def __init__(self, active: ActiveConversations, now: Callable[[], float]) -> None:
        self._active = active
        self._now = now

    def collect(self) -> Iterator[Metric]:
        g = GaugeMetricFamily("kvgate_active_conversations", "Distinct conversations with a completed request "
                              f"through this gateway in the last {self._active.window_s:.0f} s (HyperLogLog "
                              "estimate, about 2% error).", labels=["model_name"])
        now = self._now()
        for model in self._active.models():
            g.add_metric([model], self._active.count(model, now))
        yield g


class PrefixCollector(Collector):
    """KV event and index figures, read at scrape time: the event counters, the precise and approximate
    indexes, and the tokenizer parity failures per model."""

    def __init__(self, stats: EventStats, indexes: Mapping[str, PrefixIndex],
                 parity_failures: Callable[[], Mapping[str, int]]) -> None:
        self._stats = stats
        self._indexes = indexes
        self._parity = parity_failures

    def collect(self) -> Iterator[Metric]:
        st = self._stats
        for name, doc, value in (
            ("kvgate_kv_events_applied", "KV events applied to the prefix index.", st.applied),
            ("kvgate_kv_event_batches", "KV event batches received.", st.batches),
            ("kvgate_kv_event_batches_malformed", "KV event batches that could not be decoded.", st.malformed),
            ("kvgate_kv_event_gaps", "Sequence gaps detected (batches lost).", st.gaps),
            ("kvgate_kv_event_publisher_restarts", "Publishers that restarted (sequence reset).", st.restarts),
            ("kvgate_kv_event_replays_failed", "Gaps that replay could not fill (worker index dropped).",
             st.replays_failed),
            ("kvgate_kv_events_unknown_worker", "Event batches from workers kvgate does not know.",
             st.unknown_worker),
        ):
            c = CounterMetricFamily(name, doc)
            c.add_metric([], value)
            yield c
        g = GaugeMetricFamily("kvgate_index_blocks", "Blocks the index holds per worker and tier.",
                              labels=["worker", "tier", "mode"])
        for mode, idx in self._indexes.items():
            snap: Mapping[WorkerId, Mapping[Tier, int]] = idx.snapshot()
            for w, tiers in snap.items():
                for tier, n in tiers.items():
                    g.add_metric([w, tier, mode], n)
        yield g
        p = CounterMetricFamily("kvgate_tokenizer_parity_failures", "Local tokenizer disagreed with a worker.",
                                labels=["model_name"])
        for m, n in self._parity().items():
            p.add_metric([m], n)
        yield p
