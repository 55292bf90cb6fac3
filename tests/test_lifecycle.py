"""The session lifecycle state machine."""

from __future__ import annotations

import pytest

from kvgate.session.lifecycle import Event, IllegalTransition, Lifecycle, State
from kvgate.session.waits import WaitPlan


def test_tool_chain_then_answer() -> None:
    plan = WaitPlan(1.0, "reserve", 12.0)
    s = Lifecycle().on(Event.REQUEST, 1.0)
    assert (s.state, s.in_flight, s.before) == (State.GENERATING, 1, State.IDLE)
    s = s.on(Event.TOOL_CALLS, 2.0, tools=("grep",), plan=plan)
    assert (s.state, s.since, s.tools, s.plan) == (State.AWAITING_TOOL, 2.0, ("grep",), plan)
    s = s.on(Event.REQUEST, 3.0)
    assert s.state is State.GENERATING and s.before is State.AWAITING_TOOL and s.tools == ("grep",)
    s = s.on(Event.ANSWER, 4.0)
    assert (s.state, s.tools, s.plan) == (State.AWAITING_USER, (), None)


def test_failure_returns_to_the_waiting_state_before_the_request() -> None:
    s = Lifecycle().on(Event.REQUEST, 0).on(Event.TOOL_CALLS, 1, tools=("t",)).on(Event.REQUEST, 2)
    assert s.on(Event.FAILED, 3).state is State.AWAITING_TOOL


def test_parallel_branches_leave_generating_with_the_last() -> None:
    s = Lifecycle().on(Event.REQUEST, 0).on(Event.REQUEST, 0)
    assert s.in_flight == 2
    s = s.on(Event.TOOL_CALLS, 1, tools=("a",))
    assert s.state is State.GENERATING and s.in_flight == 1
    assert s.on(Event.ANSWER, 2).state is State.AWAITING_USER


@pytest.mark.parametrize("state", [State.IDLE, State.AWAITING_TOOL, State.AWAITING_USER])
@pytest.mark.parametrize("event", [Event.TOOL_CALLS, Event.ANSWER, Event.FAILED])
def test_only_a_request_leaves_a_waiting_state(state: State, event: Event) -> None:
    with pytest.raises(IllegalTransition):
        Lifecycle(state).on(event, 0)


def test_json_round_trip() -> None:
    s = Lifecycle().on(Event.REQUEST, 0).on(Event.TOOL_CALLS, 1, tools=("a", "b"),
                                             plan=WaitPlan(30.0, "release", 31.0, 29.0))
    assert Lifecycle.from_json(s.to_json()) == s
