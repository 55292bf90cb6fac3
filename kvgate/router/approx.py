"""Approximate prefix knowledge for workers that publish no KV events: kvgate assumes a prompt it
routed stays cached on that worker for ``ttl_s`` after the last time it was routed there (as llm-d's
and Dynamo's approximate indexers do). Pure: the caller passes the time."""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from kvgate.router.index import PrefixIndex
from kvgate.router.types import WorkerId


class ApproxIndex:
    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self.index = PrefixIndex()
        self._latest: dict[tuple[WorkerId, int], float] = {}
        self._expiry: list[tuple[float, int, WorkerId, tuple[int, ...]]] = []
        self._seq = 0

    def record(self, worker: WorkerId, hashes: Sequence[int], now: float) -> None:
        if not hashes:
            return
        until = now + self.ttl_s
        self.index.store(worker, hashes)
        for h in hashes:
            self._latest[(worker, h)] = until
        self._seq += 1
        heapq.heappush(self._expiry, (until, self._seq, worker, tuple(hashes)))

    def expire(self, now: float) -> None:
        while self._expiry and self._expiry[0][0] <= now:
            _, _, w, hs = heapq.heappop(self._expiry)
            # Only blocks not routed there again since: a younger record keeps them.
            gone = [h for h in hs if self._latest.get((w, h), 0.0) <= now]
            for h in gone:
                self._latest.pop((w, h), None)
            self.index.remove(w, gone)

    def match(self, hashes: Sequence[int], now: float, workers: Sequence[WorkerId] | None = None
              ) -> dict[WorkerId, int]:
        self.expire(now)
        return self.index.match(hashes, workers=workers)

    def drop_worker(self, worker: WorkerId) -> None:
        self.index.drop_worker(worker)
        for key in [k for k in self._latest if k[0] == worker]:
            del self._latest[key]
