"""The session controller, driven in memory: events in, commands out, no clock, no I/O."""

from __future__ import annotations

from dataclasses import replace

from kvgate.router.cost import CostParams
from kvgate.router.types import WorkerId
from kvgate.session.controller import (
    ArmTimer,
    CancelPrefill,
    CancelTimers,
    ComputePrefix,
    ControllerParams,
    Count,
    IssuePrefill,
    Observe,
    Prefetch,
    Reserve,
    SessionController,
    Step,
    Unreserve,
)
from kvgate.session.lifecycle import State
from kvgate.session.prefill import PrefillParams
from kvgate.session.state import LAPSE, PREFETCH, PREFILL, SETTLE, ContinuationObserved, Learned, SessionState
from kvgate.session.waits import WaitParams

W = WorkerId("w0")


def ctl(**prefill: object) -> SessionController:
    return SessionController(ControllerParams(PrefillParams(**prefill)))  # type: ignore[arg-type]


def learned(**waits: object) -> Learned:
    return Learned(WaitParams(**waits))  # type: ignore[arg-type]


def of(step: Step, kind: type) -> list:  # type: ignore[type-arg]
    return [c for c in step.commands if isinstance(c, kind)]


def tool_turn(c: SessionController, L: Learned, now: float = 0.0, tools: tuple[str, ...] = ("t",),
              s: SessionState | None = None, parked_budget: int | None = None) -> Step:
    a = c.arrived(s or SessionState(), tenant="x", now=now, user_turn=True)
    return c.ended(a.state, tenant="x", worker=W, now=now + 1, tools=tools, kv_tokens=4000, cached_tokens=0,
                   learned=L, parked_budget=parked_budget)


def answer_turn(c: SessionController, L: Learned, s: SessionState, now: float, cached: int | None = 0) -> Step:
    a = c.arrived(s, tenant="x", now=now, user_turn=True)
    return c.ended(a.state, tenant="x", worker=W, now=now + 1, tools=(), kv_tokens=3000, cached_tokens=cached,
                   learned=L)


def test_a_short_wait_reserves_its_kv_and_lapses_on_its_timer() -> None:
    c, L = ctl(), learned(tool_priors_s={"t": 1.0}, deadline_factor=2.0)
    step = tool_turn(c, L)
    assert step.state.lifecycle.state is State.AWAITING_TOOL
    [res] = of(step, Reserve)
    [arm] = of(step, ArmTimer)
    assert res == Reserve(W, 4000, 3.0, arm.token) and arm.kind == LAPSE and arm.due == 3.0
    fired = c.fired(step.state, kind=LAPSE, token=arm.token, home=W)
    assert of(fired, Unreserve) == [Unreserve(W, 4000)] and fired.state.reservation is None
    assert Count("tool_waits", "reservation_lapsed") in fired.commands
    # A second firing (another replica re-claimed the lease) finds nothing to do.
    assert c.fired(fired.state, kind=LAPSE, token=arm.token, home=W).commands == ()


def test_a_long_wait_releases_and_prefetches_before_the_predicted_resume() -> None:
    c, L = ctl(), learned(tool_priors_s={"t": 30.0}, prefetch_lead_s=2.0)
    step = tool_turn(c, L)
    assert not of(step, Reserve)
    [arm] = of(step, ArmTimer)
    assert arm.kind == PREFETCH and arm.due == 1 + 30 - 2
    assert of(c.fired(step.state, kind=PREFETCH, token=arm.token, home=W), Prefetch) == [Prefetch(W)]


def test_the_next_request_cancels_timers_and_reservation_and_feeds_the_wait_back_on_completion() -> None:
    c, L = ctl(), learned(tool_priors_s={"t": 1.0})
    step = tool_turn(c, L)
    a = c.arrived(step.state, tenant="x", now=1.5, user_turn=False)
    assert Unreserve(W, 4000) in a.commands and CancelTimers((LAPSE,)) in a.commands
    assert not of(a, Observe)  # only when it completes: a failed request teaches nothing
    done = c.ended(a.state, tenant="x", worker=W, now=2, tools=(), kv_tokens=10, cached_tokens=0, learned=L)
    [obs] = of(done, Observe)
    assert obs.observation.waited_s == 0.5 and Count("tool_waits", "within") in done.commands


def test_a_retried_request_feeds_its_wait_back_once() -> None:
    c, L = ctl(), learned(tool_priors_s={"t": 30.0})
    parked = tool_turn(c, L).state
    c.arrived(parked, tenant="x", now=5, user_turn=False)  # this attempt fails: nothing is written
    retry = c.arrived(parked, tenant="x", now=6, user_turn=False)
    done = c.ended(retry.state, tenant="x", worker=W, now=7, tools=(), kv_tokens=10, cached_tokens=0, learned=L)
    assert len(of(done, Observe)) == 1


def test_an_answer_arms_settle_and_prefill_and_the_settle_counts_an_end() -> None:
    c, L = ctl(enabled=True, settle_s=100.0), learned()
    step = answer_turn(c, L, SessionState(), 0)
    kinds = {a.kind: a for a in of(step, ArmTimer)}
    assert set(kinds) == {SETTLE, PREFILL} and kinds[SETTLE].due == 101 and kinds[PREFILL].due == 1
    settled = c.fired(step.state, kind=SETTLE, token=kinds[SETTLE].token, home=W)
    assert of(settled, Observe) == [Observe(ContinuationObserved("x", 3000, False))]
    # A user who comes back in time is counted as continuing instead.
    back = answer_turn(c, L, step.state, 50)
    assert Observe(ContinuationObserved("x", 3000, True)) in back.commands


def test_prefill_is_issued_and_a_request_that_comes_first_is_forced_to_its_worker() -> None:
    c, L = ctl(enabled=True, min_continue=0.5, min_gain_tokens=64), learned()
    step = answer_turn(c, L, SessionState(), 0)
    token = step.state.timer(PREFILL)
    assert token is not None
    fired = c.fired(step.state, kind=PREFILL, token=token, home=W)
    assert of(fired, ComputePrefix) == [ComputePrefix(W, token)]
    ready = c.prefix_ready(fired.state, token=token, worker=W, divergence=1000, prefix_tokens=2000, block_size=16,
                           pending_requests=0, kv_usage=0.1, cost=CostParams(p1_ms=0.01), learned=L)
    assert of(ready, IssuePrefill) == [IssuePrefill(W, token, 1008)] and ready.state.prefill is not None
    arrived = c.arrived(ready.state, tenant="x", now=2, user_turn=True)
    assert arrived.force == W and CancelPrefill(W, token) in arrived.commands
    assert Count("prefills", "skipped") in arrived.commands
    used = c.ended(arrived.state, tenant="x", worker=W, now=3, tools=(), kv_tokens=2500, cached_tokens=1500,
                   learned=L)
    assert Count("prefills", "used") in used.commands and used.state.prefill is None
    assert any(x.name == "prefill_saved_ms" and x.amount > 0 for x in of(used, Count))


def test_prefill_respects_the_rule() -> None:
    c, L = ctl(enabled=True, min_continue=0.9), learned()  # the prior 1:1 gives 0.5 < 0.9
    step = answer_turn(c, L, SessionState(), 0)
    token = step.state.timer(PREFILL)
    assert token is not None
    fired = c.fired(step.state, kind=PREFILL, token=token, home=W)
    ready = c.prefix_ready(fired.state, token=token, worker=W, divergence=1000, prefix_tokens=2000, block_size=16,
                           pending_requests=0, kv_usage=0.1, cost=CostParams(), learned=L)
    assert ready.commands == (Count("prefill_decisions", "unlikely_to_continue"),)


def test_stale_timers_are_ignored() -> None:
    c, L = ctl(enabled=True), learned(tool_priors_s={"t": 1.0})
    step = tool_turn(c, L)
    token = step.state.timer(LAPSE)
    assert token is not None
    resumed = c.arrived(step.state, tenant="x", now=1.2, user_turn=False).state
    assert c.fired(resumed, kind=LAPSE, token=token, home=W) == Step(resumed)


def test_waits_are_not_planned_without_tiering() -> None:
    c = SessionController(ControllerParams(plan_waits=False))
    step = tool_turn(c, learned())
    assert step.state.lifecycle.state is State.AWAITING_TOOL and step.state.lifecycle.plan is None
    assert not of(step, Reserve) and not of(step, ArmTimer)


def test_a_parallel_branch_answering_keeps_the_reservation_record() -> None:
    c, L = ctl(), learned(tool_priors_s={"t": 1.0})
    branch = c.arrived(SessionState(), tenant="x", now=0, user_turn=True).state
    two = c.arrived(branch, tenant="x", now=0, user_turn=False).state  # two branches in flight
    tooled = c.ended(two, tenant="x", worker=W, now=1, tools=("t",), kv_tokens=100, cached_tokens=0, learned=L)
    assert tooled.state.lifecycle.state is State.GENERATING and tooled.state.reservation is not None
    answered = c.ended(tooled.state, tenant="x", worker=W, now=1.1, tools=(), kv_tokens=100, cached_tokens=0,
                       learned=L)
    assert answered.state.reservation == tooled.state.reservation  # its lapse timer still releases it
    assert replace(answered.state.lifecycle).state is State.AWAITING_USER


def test_a_prefill_whose_replica_died_runs_again_when_its_timer_is_claimed_again() -> None:
    c, L = ctl(enabled=True, min_continue=0.5, min_gain_tokens=64), learned()
    step = answer_turn(c, L, SessionState(), 0)
    token = step.state.timer(PREFILL)
    assert token is not None

    def ready(s: SessionState) -> Step:
        fired = c.fired(s, kind=PREFILL, token=token, home=W)
        assert of(fired, ComputePrefix) == [ComputePrefix(W, token)]
        return c.prefix_ready(fired.state, token=token, worker=W, divergence=1000, prefix_tokens=2000,
                              block_size=16, pending_requests=0, kv_usage=0.1, cost=CostParams(), learned=L)

    issued = ready(step.state)  # this replica dies while the prefill runs: nothing more is written
    again = ready(issued.state)  # the lease ends; another replica claims the same timer
    assert of(again, IssuePrefill) == [IssuePrefill(W, token, 1008)]
    assert Count("prefills", "wasted") not in again.commands
    done = c.prefill_done(again.state, token=token, ok=True)
    assert done.state.timer(PREFILL) is None and done.state.prefill is not None and not done.state.prefill.running
    assert c.fired(done.state, kind=PREFILL, token=token, home=W) == Step(done.state)  # a late re-claim: stale


# -- tenant budgets ----------------------------------------------------------------------------------
def test_a_short_wait_over_the_parked_budget_is_released_and_prefetched_instead() -> None:
    c, L = ctl(), learned(tool_priors_s={"t": 1.0}, prefetch_lead_s=0.5)
    step = tool_turn(c, L, parked_budget=3999)  # the context is 4000 tokens
    assert not of(step, Reserve) and step.state.reservation is None
    assert Count("wait_plans", "over_budget") in step.commands and Count("wait_plans", "reserve") not in step.commands
    [arm] = of(step, ArmTimer)
    # Planned as a long wait: prefetched prefetch_lead_s before the predicted resume (1 + 1.0 s).
    assert arm.kind == PREFETCH and arm.due == 1.5
    plan = step.state.lifecycle.plan
    assert plan is not None and plan.action == "release" and plan.deadline == 2.0
    assert of(c.fired(step.state, kind=PREFETCH, token=arm.token, home=W), Prefetch) == [Prefetch(W)]


def test_a_short_wait_within_the_parked_budget_is_reserved() -> None:
    c, L = ctl(), learned(tool_priors_s={"t": 1.0})
    for budget in (4000, None):
        step = tool_turn(c, L, parked_budget=budget)
        [res] = of(step, Reserve)
        assert res.tokens == 4000 and Count("wait_plans", "reserve") in step.commands


def test_a_long_wait_is_released_whatever_the_budget() -> None:
    c, L = ctl(), learned(tool_priors_s={"t": 30.0})
    step = tool_turn(c, L, parked_budget=0)
    assert Count("wait_plans", "release") in step.commands and not of(step, Reserve)


def test_a_reservation_the_store_refused_is_dropped_and_the_wait_released() -> None:
    c, L = ctl(), learned(tool_priors_s={"t": 1.0}, prefetch_lead_s=0.5)
    step = tool_turn(c, L)
    [res] = of(step, Reserve)
    refused = c.reservation_refused(step.state, token=res.token, learned=L)
    assert refused.state.reservation is None and refused.state.timer(LAPSE) is None
    assert not of(refused, Unreserve)  # the store holds nothing: the worker's accounting was never charged
    assert CancelTimers((LAPSE,)) in refused.commands
    assert Count("tool_waits", "reservation_refused") in refused.commands
    [arm] = of(refused, ArmTimer)
    assert arm.kind == PREFETCH and arm.due == 1.5
    # The next request releases nothing.
    assert not of(c.arrived(refused.state, tenant="x", now=1.2, user_turn=False), Unreserve)
    # A refusal that comes after the wait ended (or for another reservation) changes nothing.
    resumed = c.arrived(step.state, tenant="x", now=1.2, user_turn=False).state
    assert c.reservation_refused(resumed, token=res.token, learned=L) == Step(resumed)


def _prefix_ready(c: SessionController, L: Learned, budget: float | None) -> Step:
    step = answer_turn(c, L, SessionState(), 0)
    token = step.state.timer(PREFILL)
    assert token is not None
    fired = c.fired(step.state, kind=PREFILL, token=token, home=W)
    # gain: 2000 - 1000 // 16 * 16 = 1008 tokens
    return c.prefix_ready(fired.state, token=token, worker=W, divergence=1000, prefix_tokens=2000, block_size=16,
                          pending_requests=0, kv_usage=0.1, cost=CostParams(), learned=L, prefill_budget=budget)


def test_a_prefill_over_the_tenants_prefill_budget_is_not_issued() -> None:
    c, L = ctl(enabled=True, min_continue=0.5, min_gain_tokens=64), learned()
    over = _prefix_ready(c, L, 1007.0)
    assert over.commands == (Count("prefill_decisions", "over_budget"),)
    assert over.state.timer(PREFILL) is None and over.state.prefill is None
    within = _prefix_ready(c, L, 1008.0)
    assert of(within, IssuePrefill) == [IssuePrefill(W, within.state.prefill.token, 1008)]  # type: ignore[union-attr]
    assert of(_prefix_ready(c, L, None), IssuePrefill)


# -- an answer's KV kept for as long as its request asked (cache_control, prompt_cache_retention) ----------
def kept(c: SessionController, retain_s: float | None, parked_budget: int | None = None,
         s: SessionState | None = None, now: float = 10.0) -> Step:
    a = c.arrived(s or SessionState(), tenant="x", now=now - 1, user_turn=True)
    return c.ended(a.state, tenant="x", worker=W, now=now, tools=(), kv_tokens=3000, cached_tokens=0,
                   learned=learned(), parked_budget=parked_budget, retain_s=retain_s)


def test_an_answer_that_asked_for_retention_is_reserved_until_it_lapses() -> None:
    c = ctl(settle_s=100.0)
    step = kept(c, 300.0)
    assert step.state.lifecycle.state is State.AWAITING_USER
    [res] = of(step, Reserve)
    lapse = next(a for a in of(step, ArmTimer) if a.kind == LAPSE)
    assert res == Reserve(W, 3000, 310.0, lapse.token) and lapse.due == 310.0
    assert step.state.reservation is not None and step.state.reservation.until == 310.0
    assert Count("retentions", "reserve") in step.commands
    assert step.state.timer(SETTLE) is not None  # the answer's own timers stand beside it
    fired = c.fired(step.state, kind=LAPSE, token=lapse.token, home=W)
    assert of(fired, Unreserve) == [Unreserve(W, 3000)] and fired.state.reservation is None
    assert Count("retentions", "lapsed") in fired.commands


def test_an_answer_that_asked_for_nothing_is_not_reserved() -> None:
    c = ctl()
    for retain in (None, 0.0):
        step = kept(c, retain)
        assert not of(step, Reserve) and step.state.reservation is None
        assert all(a.kind != LAPSE for a in of(step, ArmTimer))


def test_the_retention_is_capped_and_a_zero_cap_ignores_it() -> None:
    capped = SessionController(ControllerParams(max_retain_s=600.0))
    [res] = of(kept(capped, 86400.0), Reserve)
    assert res.until == 10.0 + 600.0
    off = SessionController(ControllerParams(max_retain_s=0.0))
    assert not of(kept(off, 3600.0), Reserve)


def test_a_retention_over_the_parked_budget_is_not_reserved_and_counted() -> None:
    c = ctl()
    over = kept(c, 300.0, parked_budget=2999)  # the context is 3000 tokens
    assert not of(over, Reserve) and over.state.reservation is None and over.state.timer(LAPSE) is None
    assert Count("retentions", "over_budget") in over.commands
    assert of(kept(c, 300.0, parked_budget=3000), Reserve)


def test_the_next_request_releases_a_retention() -> None:
    c = ctl()
    step = kept(c, 3600.0)
    back = c.arrived(step.state, tenant="x", now=60.0, user_turn=True)
    assert of(back, Unreserve) == [Unreserve(W, 3000)] and back.state.reservation is None
    assert LAPSE in of(back, CancelTimers)[0].kinds


def test_tool_calls_keep_the_wait_plan_whatever_the_retention() -> None:
    c, L = ctl(), learned(tool_priors_s={"t": 30.0})
    a = c.arrived(SessionState(), tenant="x", now=0, user_turn=True)
    step = c.ended(a.state, tenant="x", worker=W, now=1, tools=("t",), kv_tokens=4000, cached_tokens=0, learned=L,
                   retain_s=3600.0)
    assert not of(step, Reserve) and step.state.lifecycle.plan is not None
    assert step.state.lifecycle.plan.action == "release"


def test_a_branch_still_in_flight_or_a_held_reservation_is_not_retained_again() -> None:
    c, L = ctl(), learned(tool_priors_s={"t": 1.0})
    branch = c.arrived(SessionState(), tenant="x", now=0, user_turn=True).state
    two = c.arrived(branch, tenant="x", now=0, user_turn=False).state
    first = c.ended(two, tenant="x", worker=W, now=1, tools=(), kv_tokens=100, cached_tokens=0, learned=L,
                    retain_s=300.0)
    assert first.state.lifecycle.state is State.GENERATING and not of(first, Reserve)
    tooled = c.ended(c.arrived(branch, tenant="x", now=0, user_turn=False).state, tenant="x", worker=W, now=1,
                     tools=("t",), kv_tokens=100, cached_tokens=0, learned=L)
    answered = c.ended(tooled.state, tenant="x", worker=W, now=1.1, tools=(), kv_tokens=100, cached_tokens=0,
                       learned=L, retain_s=300.0)
    assert not of(answered, Reserve) and answered.state.reservation == tooled.state.reservation


def test_a_retention_the_store_refused_is_dropped() -> None:
    c = ctl()
    step = kept(c, 300.0)
    [res] = of(step, Reserve)
    refused = c.reservation_refused(step.state, token=res.token, learned=learned())
    assert refused.state.reservation is None and refused.state.timer(LAPSE) is None
    assert Count("retentions", "refused") in refused.commands and not of(refused, ArmTimer)
