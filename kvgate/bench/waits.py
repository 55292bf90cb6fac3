"""Where a request's time to first token goes, in the virtual-time fleet.

From its arrival to its first token a request sits on one worker through a run of engine steps. The
first may already be running when it arrives (steps are not preemptible); each later one is split by
the step's own timing model into this request's prefill chunk, other requests' prefill chunks (queued
ahead of it or packed into the same pass) and the decode work of the running batch. The parts add up
to the TTFT exactly (a test checks it), so a policy's mean TTFT can be read as "waiting for the step in
flight + own prefill + others' prefill + decode interference".
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvgate.sim.engine import StepPlan
from kvgate.sim.timing import TimingProfile


@dataclass(slots=True)
class Wait:
    arrival: float
    ahead: int
    """Requests already waiting for their first token on the worker when this one arrived."""
    in_flight_ms: float = 0.0
    """The rest of the step that was running when the request arrived."""
    own_prefill_ms: float = 0.0
    other_prefill_ms: float = 0.0
    decode_ms: float = 0.0
    passes: int = 0

    @property
    def total_ms(self) -> float:
        return self.in_flight_ms + self.own_prefill_ms + self.other_prefill_ms + self.decode_ms


@dataclass(slots=True)
class _WorkerWaits:
    pending: dict[str, Wait] = field(default_factory=dict)
    step_start: float | None = None
    present: frozenset[str] = frozenset()


class WaitTracker:
    def __init__(self, n_workers: int) -> None:
        self._w = [_WorkerWaits() for _ in range(n_workers)]

    def arrived(self, w: int, rid: str, now: float) -> None:
        ww = self._w[w]
        ww.pending[rid] = Wait(now, len(ww.pending))

    def step_started(self, w: int, now: float) -> None:
        ww = self._w[w]
        ww.step_start = now
        ww.present = frozenset(ww.pending)

    def step_done(self, w: int, plan: StepPlan, profile: TimingProfile, now: float) -> None:
        ww = self._w[w]
        if ww.step_start is None:
            return
        chunks = [(s.num_new, s.context) for s in plan.scheduled if not (s.num_new == 1 and s.request.generated > 0)]
        own = {s.request.id: s.num_new for s in plan.scheduled
               if not (s.num_new == 1 and s.request.generated > 0)}
        dur_ms = (now - ww.step_start) * 1000.0
        prefill = min(dur_ms, profile.prefill_ms(chunks))
        total = sum(c for c, _ in chunks)
        for rid, wt in ww.pending.items():
            if rid not in ww.present:
                wt.in_flight_ms += (now - wt.arrival) * 1000.0
                continue
            mine = prefill * own.get(rid, 0) / total if total else 0.0
            wt.own_prefill_ms += mine
            wt.other_prefill_ms += prefill - mine
            wt.decode_ms += dur_ms - prefill
            wt.passes += 1
        ww.step_start = None

    def first_token(self, w: int, rid: str) -> Wait | None:
        return self._w[w].pending.pop(rid, None)


def breakdown(waits: list[Wait]) -> dict[str, float]:
    """Mean milliseconds per part over ``waits`` (and the mean number of requests found ahead)."""
    n = max(1, len(waits))
    return {"in flight": sum(x.in_flight_ms for x in waits) / n,
            "own prefill": sum(x.own_prefill_ms for x in waits) / n,
            "others' prefill": sum(x.other_prefill_ms for x in waits) / n,
            "decode": sum(x.decode_ms for x in waits) / n,
            "ahead": sum(x.ahead for x in waits) / n}
