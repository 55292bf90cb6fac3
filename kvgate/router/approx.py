"""Approximate prefix knowledge for workers that publish no KV events: kvgate assumes a prompt it
routed stays cached on that worker for ``ttl_s`` after the last time it was routed there (as llm-d's
and Dynamo's approximate indexers do). Pure: the caller passes the time.

The same structure, with a short TTL, holds the prompts in flight on workers that do publish events
(``gateway/prefix.py``): counted there from dispatch until their blocks arrive by events (``forget``).

Bounded by what the worker can hold: no worker caches more blocks than its KV capacity, so a worker's
blocks past ``capacity(worker)`` are forgotten least recently routed first — without it the index grew
with every distinct prompt routed within the TTL (~9 KB a 2,500-token conversation at 16-token blocks,
issue 24's memory finding), whatever the store's byte bound."""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence

from kvgate.router.index import PrefixIndex
from kvgate.router.types import WorkerId


class ApproxIndex:
    def __init__(self, ttl_s: float, capacity: Callable[[WorkerId], int] | None = None) -> None:
        """``capacity``: a worker's KV capacity in blocks (0: not known, not bounded)."""
        self.ttl_s = ttl_s
        self._capacity = capacity
        self.index = PrefixIndex()
        self._latest: dict[WorkerId, dict[int, float]] = {}
        self._expiry: list[tuple[float, int, WorkerId, tuple[int, ...]]] = []
        self._seq = 0

    def record(self, worker: WorkerId, hashes: Sequence[int], now: float) -> None:
        if not hashes:
            return
        until = now + self.ttl_s
        self.index.store(worker, hashes)
        latest = self._latest.setdefault(worker, {})
        for h in hashes:
            latest.pop(h, None)  # to the end: the dict's order is the order blocks were last routed
            latest[h] = until
        self._seq += 1
        heapq.heappush(self._expiry, (until, self._seq, worker, tuple(hashes)))
        self._trim(worker, latest)

    def stale(self, worker: WorkerId, hashes: Sequence[int], before: float) -> list[int]:
        """Of ``hashes``, those not assumed on ``worker`` or assumed only until earlier than ``before``."""
        latest = self._latest.get(worker, {})
        return [h for h in hashes if latest.get(h, 0.0) < before]

    def merge(self, worker: WorkerId, entries: Sequence[tuple[int, float]]) -> int:
        """Blocks another replica routed to ``worker``, each with when (this index's clock): each only
        extends what is assumed, never shortens it. Returns how many were new or extended."""
        latest = self._latest.setdefault(worker, {})
        got: dict[float, list[int]] = {}
        for h, at in sorted(entries, key=lambda e: e[1]):  # oldest first: the dict's order stays roughly LRU
            until = at + self.ttl_s
            if latest.get(h, 0.0) < until:
                latest.pop(h, None)
                latest[h] = until
                got.setdefault(until, []).append(h)
        for until, hs in got.items():
            self.index.store(worker, hs)
            self._seq += 1
            heapq.heappush(self._expiry, (until, self._seq, worker, tuple(hs)))
        self._trim(worker, latest)
        return sum(len(hs) for hs in got.values())

    def _trim(self, worker: WorkerId, latest: dict[int, float]) -> None:
        cap = self._capacity(worker) if self._capacity is not None else 0
        if 0 < cap < len(latest):
            over = [h for h, _ in zip(latest, range(len(latest) - cap), strict=False)]
            for h in over:
                del latest[h]
            self.index.remove(worker, over)

    def expire(self, now: float) -> None:
        while self._expiry and self._expiry[0][0] <= now:
            _, _, w, hs = heapq.heappop(self._expiry)
            # Only blocks not routed there again since: a younger record keeps them.
            latest = self._latest.get(w, {})
            gone = [h for h in hs if latest.get(h, 0.0) <= now]
            for h in gone:
                latest.pop(h, None)
            self.index.remove(w, gone)

    def match(self, hashes: Sequence[int], now: float, workers: Sequence[WorkerId] | None = None
              ) -> dict[WorkerId, int]:
        self.expire(now)
        return self.index.match(hashes, workers=workers)

    def forget(self, worker: WorkerId, hashes: Sequence[int]) -> None:
        """These blocks are no longer assumed (their expiry records lapse harmlessly)."""
        latest = self._latest.get(worker)
        if latest:
            for h in hashes:
                latest.pop(h, None)
            self.index.remove(worker, hashes)

    def holds(self, worker: WorkerId) -> bool:
        return bool(self._latest.get(worker))

    def drop_worker(self, worker: WorkerId) -> None:
        self.index.drop_worker(worker)
        self._latest.pop(worker, None)
