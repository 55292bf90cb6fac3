"""The session lifecycle: one explicit state machine.

::

    idle ──request──▶ generating ──tool_calls──▶ awaiting_tool ──request──▶ generating ...
                          │  ▲                                                  │
                          │  └──────────────request─── awaiting_user ◀──answer──┘
                          └──failed──▶ (the state before the request)

``generating`` counts its requests: an agent may run branches of one conversation in parallel, and
the session leaves ``generating`` when the last one ends (the last one to end decides where it goes).
A wait records when it began and its plan (``session/waits.py``), so the next request can measure the
real wait and feed it back. Anything else is an illegal transition and raises: a bug, not an input.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from typing import Any

from kvgate.session.waits import WaitPlan


class State(enum.StrEnum):
    IDLE = "idle"
    GENERATING = "generating"
    AWAITING_TOOL = "awaiting_tool"
    AWAITING_USER = "awaiting_user"


class Event(enum.StrEnum):
    REQUEST = "request"
    TOOL_CALLS = "tool_calls"
    ANSWER = "answer"
    FAILED = "failed"


class IllegalTransition(RuntimeError):
    pass


_WAITING = (State.IDLE, State.AWAITING_TOOL, State.AWAITING_USER)

TRANSITIONS: dict[tuple[State, Event], State] = {
    **{(s, Event.REQUEST): State.GENERATING for s in (*_WAITING, State.GENERATING)},
    (State.GENERATING, Event.TOOL_CALLS): State.AWAITING_TOOL,
    (State.GENERATING, Event.ANSWER): State.AWAITING_USER,
}


@dataclass(frozen=True, slots=True)
class Lifecycle:
    state: State = State.IDLE
    since: float = 0.0
    in_flight: int = 0
    before: State = State.IDLE
    """The waiting state a failed request returns to."""
    tools: tuple[str, ...] = ()
    """The tools the session waits on (awaiting_tool)."""
    plan: WaitPlan | None = None

    def on(self, event: Event, now: float, *, tools: tuple[str, ...] = (), plan: WaitPlan | None = None) -> Lifecycle:
        if event is Event.FAILED:
            if self.state is not State.GENERATING:
                raise IllegalTransition(f"{event} in {self.state}")
            if self.in_flight > 1:
                return replace(self, in_flight=self.in_flight - 1)
            return replace(self, state=self.before, in_flight=0)
        nxt = TRANSITIONS.get((self.state, event))
        if nxt is None:
            raise IllegalTransition(f"{event} in {self.state}")
        if nxt is State.GENERATING:
            if self.state is State.GENERATING:
                return replace(self, in_flight=self.in_flight + 1)
            return Lifecycle(State.GENERATING, now, 1, self.state, self.tools, self.plan)
        if self.in_flight > 1:
            return replace(self, in_flight=self.in_flight - 1)
        return Lifecycle(nxt, now, 0, nxt, tools if nxt is State.AWAITING_TOOL else (), plan)

    def to_json(self) -> dict[str, Any]:
        p = self.plan
        return {"state": self.state.value, "since": self.since, "in_flight": self.in_flight,
                "before": self.before.value, "tools": list(self.tools),
                "plan": None if p is None else [p.predicted_s, p.action, p.deadline, p.prefetch_at]}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Lifecycle:
        p = d.get("plan")
        return cls(State(d["state"]), float(d["since"]), int(d["in_flight"]), State(d["before"]),
                   tuple(d.get("tools", ())), WaitPlan(*p) if p else None)
