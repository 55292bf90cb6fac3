"""The fleet's routed-prefix record (``kvstore/routed.py``) kept in step with this replica's approximate
index (``gateway/prefix.py``): what it routes to a worker without KV events is published in batches, and
what the others routed is merged in every ``poll_s`` — so every replica's index holds the fleet's routes,
not only its own, and one that joins starts with them instead of with nothing.

Off the request's path: a route only appends to a bounded pending buffer; the poll task writes it in one
pipeline. Advice only: when the store fails, each replica routes on what it routed itself (as without a
shared store), and the failure is counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections.abc import Callable
from typing import Any

from kvgate.gateway.prefix import PrefixKnowledge
from kvgate.kvstore.routed import RoutedRecord
from kvgate.router.hashing import HashSpec
from kvgate.router.types import WorkerId
from kvgate.tasks import cancel_and_wait, stopping

log = logging.getLogger("kvgate.routed")

MAX_PENDING = 1 << 16
"""Blocks waiting to be written (8 bytes + a time each); past it new ones are dropped and counted — a
store that cannot keep up costs the others reuse, never this replica memory."""

DEFAULT_BLOCKS = 1 << 15
"""Blocks a worker's record keeps when its KV capacity is not known."""


def spec_tag(spec: HashSpec) -> str:
    """A short name for a hash identity: replicas that hash alike share a record, others never mix."""
    ident = f"{spec.family}|{spec.block_size}|{spec.algo}|{spec.seed}"
    return hashlib.sha256(ident.encode()).hexdigest()[:12]


class RoutedSync:
    def __init__(self, record: RoutedRecord, prefix: PrefixKnowledge, workers: Callable[[], list[WorkerId]],
                 capacity_blocks: Callable[[WorkerId], int], now: Callable[[], float], wall: Callable[[], float],
                 poll_s: float = 0.25) -> None:
        """``now``: the clock the approximate index runs on; ``wall``: the time shared with the others."""
        self.record = record
        self.prefix = prefix
        self._workers = workers
        self._capacity = capacity_blocks
        self._now = now
        self._wall = wall
        self.poll_s = poll_s
        # Entries may reach the store a poll after they were routed, and clocks differ: read back a little.
        self._overlap_s = 4 * poll_s + 1.0
        self._pending: dict[tuple[WorkerId, HashSpec], list[tuple[int, float]]] = {}
        self._pending_n = 0
        self._cursor: dict[str, float] = {}
        self._floor: dict[WorkerId, float] = {}
        self.published = 0
        self.merged = 0
        self.dropped = 0
        self.failures = 0
        self._task: asyncio.Task[None] | None = None
        prefix.on_routed = self.note

    def note(self, wid: WorkerId, spec: HashSpec, hashes: list[int]) -> None:
        """This replica routed these blocks to ``wid`` (only those it has not published lately)."""
        if self._pending_n + len(hashes) > MAX_PENDING:
            self.dropped += len(hashes)
            return
        at = self._wall()
        self._pending.setdefault((wid, spec), []).extend((h, at) for h in hashes)
        self._pending_n += len(hashes)

    def worker_restarted(self, wid: WorkerId) -> None:
        """Its cache may be empty: what anyone routed there before now is not merged again."""
        self._floor[wid] = self._wall()
        for key in [k for k in self._pending if k[0] == wid]:
            self._pending_n -= len(self._pending.pop(key))

    def _name(self, wid: WorkerId, spec: HashSpec) -> str:
        return f"{wid}:{spec_tag(spec)}"

    def _cap(self, wid: WorkerId) -> int:
        return self._capacity(wid) or DEFAULT_BLOCKS

    async def start(self) -> None:
        """Warm the index from the fleet's record before serving (advice: a store down delays nothing)."""
        with contextlib.suppress(Exception):
            await self.pull()
        self._task = asyncio.create_task(self._poll(), name="kvgate-routed-sync")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        with contextlib.suppress(Exception):
            await self.push()  # what was routed since the last poll is not lost to the others
        await self.record.close()

    async def _poll(self) -> None:
        while not stopping():
            await asyncio.sleep(self.poll_s)
            try:
                await self.push()
                await self.pull()
            except Exception as exc:  # the record is advice: the next round tries again
                self.failures += 1
                if self.failures == 1 or self.failures % 100 == 0:
                    log.warning("routed record: %s (%d failures)", exc, self.failures)

    async def push(self) -> None:
        pending, self._pending, self._pending_n = self._pending, {}, 0
        batch = {self._name(w, s): (entries, self._cap(w)) for (w, s), entries in pending.items()}
        if batch:
            await self.record.publish(batch, self._wall())
            self.published += sum(len(e) for e in pending.values())

    async def pull(self) -> None:
        wall = self._wall()
        names: dict[str, tuple[WorkerId, HashSpec]] = {}
        for wid in self._workers():
            spec = self.prefix.approx_spec(wid)
            if spec is not None:
                names[self._name(wid, spec)] = (wid, spec)
        since = {n: (self._cursor.get(n, 0.0) - self._overlap_s, self._cap(w)) for n, (w, _) in names.items()}
        got = await self.record.read(since, wall)
        now = self._now()
        for name, entries in got.items():
            wid, spec = names[name]
            self._cursor[name] = wall
            floor = self._floor.get(wid, 0.0)
            local = [(h, at - wall + now) for h, at in entries if at > floor]
            if local:
                self.merged += self.prefix.merge_routed(wid, spec, local)

    def status(self) -> dict[str, Any]:
        return {"published": self.published, "merged": self.merged, "dropped": self.dropped,
                "failures": self.failures, "pending": self._pending_n, "poll_s": self.poll_s}
