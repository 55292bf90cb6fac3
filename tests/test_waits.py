"""Tool-wait prediction: priors, learning per (tenant, tool), the reserve/release plan."""

from __future__ import annotations

from kvgate.session.waits import WaitParams, WaitPredictor


def test_prior_until_enough_samples_then_the_quantile() -> None:
    p = WaitPredictor(WaitParams(prior_s=5.0, tool_priors_s={"grep": 0.5}, min_samples=3, quantile=0.9))
    assert p.predict("t", ["grep"]) == 0.5 and p.predict("t", ["make"]) == 5.0
    for d in (0.1, 0.2):
        p.observe("t", ["make"], d, 5.0)
    assert p.predict("t", ["make"]) == 5.0  # two samples are not enough
    for d in (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 9.0):
        p.observe("t", ["make"], d, 5.0)
    assert p.predict("t", ["make"]) == 0.9  # p90 of ten samples, not the outlier


def test_a_new_tenant_borrows_the_tools_durations_across_tenants() -> None:
    p = WaitPredictor(WaitParams(prior_s=30.0, min_samples=2))
    for d in (2.0, 2.0, 2.0):
        p.observe("a", ["pytest"], d, 30.0)
    assert p.predict("b", ["pytest"]) == 2.0
    assert p.predict("b", ["pytest", "other"]) == 30.0  # parallel tools: the slowest decides


def test_plan_reserves_short_waits_and_prefetches_before_long_ones() -> None:
    p = WaitPredictor(WaitParams(reserve_max_s=5.0, deadline_factor=2.0, prefetch_lead_s=2.0,
                                 tool_priors_s={"ls": 0.3, "build": 60.0}))
    short = p.plan("t", ["ls"], now=100.0)
    assert short.action == "reserve" and short.deadline == 100.6 and short.prefetch_at is None
    long = p.plan("t", ["build"], now=100.0)
    assert long.action == "release" and long.deadline == 160.0 and long.prefetch_at == 158.0


def test_overruns_are_counted() -> None:
    p = WaitPredictor()
    assert p.observe("t", ["x"], 10.0, 5.0) is True
    assert p.observe("t", ["x"], 1.0, 5.0) is False
    assert (p.observed, p.overruns) == (2, 1)
    assert p.observe("t", ["x"], -1.0, 5.0) is False and p.observed == 2  # a clock step is ignored


def test_keys_are_bounded() -> None:
    p = WaitPredictor(WaitParams(max_keys=4))
    for i in range(10):
        p.observe(f"tenant{i}", ["tool"], 1.0, 1.0)
    assert p.snapshot()["keys"] == 4
