"""The background prefill decision."""

from __future__ import annotations

from kvgate.sequences import common_prefix
from kvgate.session.prefill import ContinueStats, PrefillParams, PrefillStats, decide, gain_tokens, p_continue


def test_gain_counts_whole_blocks_after_the_divergence() -> None:
    chain = list(range(1000))  # P | R | A as cached
    nxt = list(range(300)) + list(range(5000, 5700))  # P | A: the reasoning after token 300 dropped
    assert gain_tokens(common_prefix(chain, nxt), len(nxt), 128) == 1000 // 128 * 128 - 256  # block 2 partly shared
    assert gain_tokens(common_prefix(chain, chain[:900]), 900, 128) == 0  # nothing dropped: the chain holds it


def test_decision_reasons() -> None:
    p = PrefillParams(min_gain_tokens=128, min_continue=0.6)
    assert decide(p, 0, 0.9, pending_requests=0, kv_usage=0).reason == "nothing_dropped"
    assert decide(p, 64, 0.9, pending_requests=0, kv_usage=0).reason == "small_gain"
    assert decide(p, 512, 0.5, pending_requests=0, kv_usage=0).reason == "unlikely_to_continue"
    assert decide(p, 512, 0.9, pending_requests=1, kv_usage=0).reason == "worker_busy"
    assert decide(p, 512, 0.9, pending_requests=0, kv_usage=0.95).reason == "kv_pressure"
    d = decide(p, 512, 0.9, pending_requests=0, kv_usage=0.2)
    assert d.issue and d.reason == "issued" and d.gain_tokens == 512
    assert not decide(PrefillParams(enabled=False), 512, 0.9, pending_requests=0, kv_usage=0).issue


def test_the_tenants_budget_is_checked_last_against_the_gain() -> None:
    p = PrefillParams(min_gain_tokens=128, min_continue=0.6)
    assert decide(p, 512, 0.9, pending_requests=0, kv_usage=0, budget=511.5).reason == "over_budget"
    assert decide(p, 512, 0.9, pending_requests=0, kv_usage=0, budget=512).issue
    assert decide(p, 512, 0.9, pending_requests=0, kv_usage=0, budget=-10).reason == "over_budget"  # in debt
    # Only prefills the budget alone prevented count as over it.
    assert decide(p, 512, 0.9, pending_requests=0, kv_usage=0.95, budget=0).reason == "kv_pressure"


def test_continuation_is_learned_per_tenant_and_size() -> None:
    c = ContinueStats(PrefillParams(prior_continue=1, prior_stop=1, bucket_weight=2))
    assert c.p("chat", 5000) == 0.5  # nothing seen: the prior
    for _ in range(8):
        c.continued("chat", 5000)  # small conversations come back
    for _ in range(6):
        c.ended("chat", 40_000)  # large ones end (context budget)
    c.ended("oneshot", 3000)
    c.ended("oneshot", 3000)
    assert c.p("chat", 6000) > 0.8
    assert c.p("chat", 45_000) < 0.3
    assert c.p("chat", 100_000) == (8 + 1) / (8 + 6 + 2)  # an unseen size: the tenant's rate
    assert c.p("oneshot", 3000) < 0.3


def test_continue_probability_is_a_beta_posterior() -> None:
    p = PrefillParams(prior_continue=3, prior_stop=1)
    assert p_continue(p, 0, 0) == 0.75
    assert p_continue(p, 17, 3) == 20 / 24
    assert p_continue(p, 100, 0) < 1.0


def test_stats_waste_fraction() -> None:
    s = PrefillStats.new()
    s.used, s.wasted = 8, 2
    assert s.waste_fraction == 0.2
