"""What kvgate knows of every worker's cache: the KV-event-fed index for workers that publish events,
the approximate index (what kvgate routed there, with a TTL) for the others."""

from __future__ import annotations

from collections.abc import Sequence

from kvgate.config import WorkerConfig
from kvgate.router.approx import ApproxIndex
from kvgate.router.index import PrefixIndex
from kvgate.router.kvevents import KvEventState
from kvgate.router.types import WorkerId


class PrefixKnowledge:
    def __init__(self, workers: Sequence[WorkerConfig], approx_ttl_s: float) -> None:
        self.index = PrefixIndex()
        self.events = KvEventState(self.index)
        self.approx = ApproxIndex(approx_ttl_s)
        self._block_size = {w.model: w.block_size for w in workers}

    def block_size(self, model: str) -> int:
        return self._block_size.get(model, 16)

    def precise(self, wid: WorkerId) -> bool:
        return self.events.follows(wid)

    def match(self, model: str, hashes: Sequence[int], workers: Sequence[WorkerId], now: float
              ) -> dict[WorkerId, int]:
        if not hashes:
            return {}
        precise = [w for w in workers if self.precise(w)]
        out = self.index.match(hashes, workers=precise) if precise else {}
        rest = [w for w in workers if not self.precise(w)]
        if rest:
            out.update(self.approx.match(hashes, now, rest))
        return out

    def routed(self, model: str, wid: WorkerId, hashes: Sequence[int], now: float) -> None:
        if not self.precise(wid):
            self.approx.record(wid, hashes, now)
