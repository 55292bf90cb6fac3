"""What a gateway knows of a simulated fleet in virtual time, shared by the fleet replays (the Mooncake
benchmark's ``bench/fleet.py``, the agent fleet of ``sim/sessions.py`` and ``kvgate tune``): its own
accounting per worker, the engines' next events, and their KV events applied to kvgate's index."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvgate.router.hashing import event_int
from kvgate.router.index import PrefixIndex
from kvgate.router.load import WorkerLoad
from kvgate.router.types import WorkerId, WorkerView
from kvgate.sim.blockpool import BlockRemoved, BlockStored, KVEvent
from kvgate.sim.engine import EngineCore, StepPlan


@dataclass(slots=True)
class Accounting(WorkerLoad):
    """What the gateway knows of one worker: ``WorkerLoad``, the very accounting ``WorkerPool`` keeps
    (``acquire`` when a request is sent, ``first_token``, ``release``), plus its estimate of the worker's
    tier-load backlog from its own decisions."""

    load_free_at: float = 0.0
    """When the tier loads sent here will have finished (s, virtual time), had each started on the engine's
    channel when it was sent: the router's estimate of the channel's backlog, from its own decisions."""

    def loading(self, ms: float, now: float) -> None:
        if ms > 0:
            self.load_free_at = max(self.load_free_at, now) + ms / 1000.0

    def load_backlog_ms(self, now: float) -> float:
        return max(0.0, self.load_free_at - now) * 1000.0

    def view(self, wid: WorkerId, **extra: Any) -> WorkerView:
        return WorkerView(wid, "m", True, self.in_flight, pending_prefill_tokens=self.pending_prefill,
                          pending_requests=self.pending_requests, decode_requests=self.decode_requests,
                          decode_tokens=self.decode_tokens, **extra)


def next_step(core: EngineCore, horizon_ms: float) -> tuple[float, StepPlan | None] | None:
    """An engine's next event in virtual time: (ms, None) for a stretch of pure decode run as one event
    (up to ``horizon_ms``), (ms, plan) for one scheduled step (or a wait for loads), None when it has
    nothing to run. The caller takes the KV events the step produced."""
    if not core.has_work():
        return None
    steps, ms = core.decode_burst(horizon_ms)
    if steps:
        return ms, None
    plan = core.schedule()
    # An empty plan with a duration: the engine only waits for tier loads (it polls its connector).
    return (plan.duration_ms, plan) if plan.scheduled or plan.duration_ms > 0 else None


def apply_events(index: PrefixIndex, wid: WorkerId, events: list[KVEvent],
                 event_int: Callable[[bytes], int] = event_int) -> None:
    """A simulated engine's KV events into kvgate's index, applied directly (the wire format is covered
    by the engine tests); ``event_int``: the engine's digest-to-id rule (``core.kind.event_int``)."""
    for ev in events:
        if isinstance(ev, BlockStored):
            index.store(wid, [event_int(h) for h in ev.block_hashes])
        elif isinstance(ev, BlockRemoved):
            index.remove(wid, [event_int(h) for h in ev.block_hashes])
        else:
            index.clear(wid)
