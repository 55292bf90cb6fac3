"""The engines' slot caps (``admission/capacity.py``) kept in step with the fleet's (``kvstore/capacity.py``):
what this replica learned is written, what the others learned is merged in (``merge_slots``: the newest
reading wins), before the replica serves and then every ``poll_s`` — the health interval, since a cap
changes only when a health round reads the engines' counters.

Advice only: with the store down each replica learns on its own (as without a shared store), and the
failure is counted. Times cross processes as wall time; each replica keeps its own clock's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from kvgate.admission.capacity import SlotEstimate, merge_slots
from kvgate.kvstore.capacity import Reading, SlotBoard
from kvgate.tasks import cancel_and_wait, stopping

log = logging.getLogger("kvgate.slots")

START_ATTEMPTS = 3


class HasSlots(Protocol):
    """A worker as the pool holds it (``gateway/workers.WorkerState``): its id and its learned cap."""

    @property
    def id(self) -> str: ...

    slots: SlotEstimate


class SlotSync:
    def __init__(self, board: SlotBoard, workers: Callable[[], Iterable[HasSlots]], now: Callable[[], float],
                 wall: Callable[[], float], replica: str, poll_s: float) -> None:
        """``now``: the clock the estimates run on (the pool's); ``wall``: the time shared with the others."""
        self.board = board
        self._workers = workers
        self._now = now
        self._wall = wall
        self.replica = replica
        self.poll_s = poll_s
        self._known: dict[str, float] = {}
        """Per worker, the reading (this clock) last written or merged: only newer ones are written."""
        self.published = 0
        self.adopted = 0
        """Caps taken from another replica's reading."""
        self.failures = 0
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """The fleet's caps before serving: a few tries (one read that timed out would leave the caps unknown
        for a whole health interval), then it serves anyway (advice: a store down delays it a little only)."""
        for attempt in range(START_ATTEMPTS):
            try:
                await self.pull()
                break
            except Exception as exc:
                log.warning("slot estimates at start (try %d of %d): %s", attempt + 1, START_ATTEMPTS, exc)
        self._task = asyncio.create_task(self._poll(), name="kvgate-slot-sync")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        with contextlib.suppress(Exception):
            await self.push()  # a cap learned in the last round still reaches the next joiner
        await self.board.close()

    async def _poll(self) -> None:
        while not stopping():
            await asyncio.sleep(self.poll_s)
            try:
                await self.push()
                await self.pull()
            except Exception as exc:  # advice: the next round tries again
                self.failures += 1
                if self.failures == 1 or self.failures % 100 == 0:
                    log.warning("slot estimates: %s (%d failures)", exc, self.failures)

    async def push(self) -> None:
        shift = self._wall() - self._now()
        batch: dict[str, Reading] = {}
        sent: dict[str, float] = {}
        for w in self._workers():
            e = w.slots
            if e.cap is not None and e.saturated_at > self._known.get(w.id, -math.inf):
                batch[w.id] = (e.cap, e.saturated_at + shift)
                sent[w.id] = e.saturated_at
        if batch:
            await self.board.publish(batch, self.replica)
            self._known.update(sent)
            self.published += len(batch)

    async def pull(self) -> None:
        workers = {w.id: w for w in self._workers()}
        wall = self._wall()
        shift = wall - self._now()
        got = await self.board.read(list(workers), wall)
        for wid, mine in workers.items():
            # Nothing usable there (removed as corrupt, expired, lost with Redis): what this replica knows is
            # written again at the next round, so the fleet does not wait for the engine's next saturation.
            e = mine.slots
            if wid not in got and e.cap is not None and self._now() - e.saturated_at < self.board.ttl_s:
                self._known.pop(wid, None)
        for wid, (cap, at, by) in got.items():
            w = workers.get(wid)
            if w is None or by == self.replica:  # its own reading, back through another clock
                continue
            merged = merge_slots(w.slots, SlotEstimate(cap, at - shift))
            if merged is not w.slots:
                w.slots = merged
                self._known[wid] = merged.saturated_at
                self.adopted += 1

    def status(self) -> dict[str, Any]:
        return {"published": self.published, "adopted": self.adopted, "failures": self.failures,
                "poll_s": self.poll_s}
