"""How many requests a worker runs at once, derived from what its engine reports, and what of that is this
replica's to hand out. Pure.

Neither vLLM nor SGLang publishes its running-request cap on ``/metrics`` (vLLM's ``--max-num-seqs`` is
only in the dev-mode ``/server_info``), and what an engine really runs at once is often less: its KV
blocks or its token budget run out first. What it does publish is enough to learn it: a poll that
shows requests *waiting* (vLLM's ``num_requests_waiting`` is counted after a step, so these are requests
the scheduler could not fit, not ones that just arrived) says the engine runs ``running`` and no more.
A poll that shows it running at least the learned cap with nothing waiting says it may run more, but
that is also what a gateway holding requests back at exactly the cap sees: the cap grows by one only
when the engine has not been seen saturated for ``probe_after_s``, so a cap learned while KV was short
comes back up without the engine queueing a request on every other poll. Until the engine has been
seen saturated, the cap is unknown and nothing is held back.

Several gateway replicas share the workers: a replica may hand out what the engine runs less what the
other replicas (and any other clients) had there at the last poll, so their queues together keep the
engines' queues empty without a shared queue.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

PROBE_AFTER_S = 60.0


@dataclass(frozen=True, slots=True)
class SlotEstimate:
    cap: int | None = None
    """Requests the engine runs at once; None until it was seen saturated."""
    saturated_at: float = -math.inf
    """When it was last seen saturated (or last probed)."""


def learn_slots(e: SlotEstimate, running: int, waiting: int, now: float, probe_after_s: float = PROBE_AFTER_S
                ) -> SlotEstimate:
    """The worker's cap after one poll of its engine's counters."""
    if waiting > 0 and running > 0:
        return SlotEstimate(running, now)
    if e.cap is not None and waiting == 0 and running >= e.cap and now - e.saturated_at >= probe_after_s:
        return SlotEstimate(e.cap + 1, now)
    return e


def foreign(running: int, waiting: int, own_in_flight: int) -> int:
    """Requests on the worker at the poll that were not this replica's."""
    return max(0, running + waiting - own_in_flight)


def free_slots(slots: int | None, foreign_requests: int) -> int | None:
    """What this replica may run on a worker at once (None: no cap known)."""
    return None if slots is None else max(0, slots - foreign_requests)


def model_capacity(workers: list[int | None]) -> int | None:
    """A model's slots on this replica: the sum of its healthy workers' (None as soon as one has no cap
    known: that worker takes whatever comes, so nothing needs to wait)."""
    total = 0
    for w in workers:
        if w is None:
            return None
        total += w
    return total


def merge_slots(mine: SlotEstimate, theirs: SlotEstimate) -> SlotEstimate:
    """This replica's estimate of a worker after reading another replica's: the more recent observation
    wins (``mine`` on a tie).

    Every replica polls the same engine, so two estimates are two readings of one quantity at different
    times, and what an engine runs at once moves with its KV (a cap learned while KV was short, a probe
    since that found room): the newest reading is the best one, as within one replica each poll that
    learns replaces the last. The maximum of the replicas' caps would keep a cap the engine no longer
    runs (over-admission, the failure sharing is meant to prevent); the minimum would keep one it has
    outgrown. Taking the other's time with its cap also paces probing fleet-wide: a replica probes one
    more slot only ``probe_after_s`` after the fleet last saw the engine saturated or probed it, so N
    replicas probe no faster than one. Clocks differ by a little: near-simultaneous readings may be
    ordered wrong, which the next saturated poll corrects."""
    if theirs.cap is None or theirs.saturated_at <= mine.saturated_at:
        return mine
    return theirs
