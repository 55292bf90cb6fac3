"""Where each KV block lives: for every worker and tier, the set of block hashes it holds.

Hashes are the 64-bit ints KV events carry. A lookup asks, per worker, for the longest prefix of the
request's block chain that worker holds. Because hashes are chained (block i's hash covers blocks
0..i), a worker that holds block i almost always holds the blocks before it (vLLM evicts a chain's
tail first), so the depth is found by binary search — O(log n) set probes — and then verified in one
C-speed ``issuperset`` over the prefix; the rare worker whose chain has a hole falls back to a linear
walk that stops at the hole. Memory: one set entry per (worker, block).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Literal

from kvgate.router.types import WorkerId

Tier = Literal["GPU", "CPU"]
TIERS: tuple[Tier, ...] = ("GPU", "CPU")


def tier_of(medium: object) -> Tier | None:
    """vLLM's event ``medium`` (None means GPU, as older engines omit it)."""
    if medium is None or medium == "GPU":
        return "GPU"
    if medium == "CPU":
        return "CPU"
    return None


def _depth(held: set[int], hashes: Sequence[int]) -> int:
    n = len(hashes)
    if n == 0 or hashes[0] not in held:
        return 0
    if hashes[-1] in held and held.issuperset(hashes):
        return n
    lo, hi = 1, n - 1  # hashes[:lo] is the candidate prefix; hashes[-1] is known missing
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if hashes[mid - 1] in held:
            lo = mid
        else:
            hi = mid - 1
    if held.issuperset(hashes[:lo]):
        return lo
    for i, h in enumerate(hashes):  # a hole in the chain: the prefix ends at the first one
        if h not in held:
            return i
    return n


class PrefixIndex:
    def __init__(self) -> None:
        self._held: dict[Tier, dict[WorkerId, set[int]]] = {t: {} for t in TIERS}

    def _set(self, worker: WorkerId, tier: Tier) -> set[int]:
        s = self._held[tier].get(worker)
        if s is None:
            for t in TIERS:
                self._held[t].setdefault(worker, set())
            s = self._held[tier][worker]
        return s

    def workers(self) -> list[WorkerId]:
        return list(self._held["GPU"])

    def block_count(self, worker: WorkerId | None = None, tier: Tier = "GPU") -> int:
        """Blocks held by ``worker``, or (worker, block) entries over all workers."""
        if worker is None:
            return sum(len(s) for s in self._held[tier].values())
        return len(self._held[tier].get(worker, ()))

    # -- updates ---------------------------------------------------------------------------------
    def store(self, worker: WorkerId, hashes: Iterable[int], tier: Tier = "GPU") -> None:
        self._set(worker, tier).update(hashes)

    def remove(self, worker: WorkerId, hashes: Iterable[int], tier: Tier = "GPU") -> int:
        """Drop blocks; returns how many were actually held (unknown ones are ignored)."""
        s = self._held[tier].get(worker)
        if not s:
            return 0
        before = len(s)
        s.difference_update(hashes)
        return before - len(s)

    def clear(self, worker: WorkerId, tier: Tier | None = None) -> int:
        """Forget everything a worker holds (AllBlocksCleared, an event gap, a worker gone)."""
        n = 0
        for t in (tier,) if tier else TIERS:
            s = self._held[t].get(worker)
            if s:
                n += len(s)
                s.clear()
        return n

    def drop_worker(self, worker: WorkerId) -> None:
        for t in TIERS:
            self._held[t].pop(worker, None)

    # -- lookups ---------------------------------------------------------------------------------
    def holds(self, worker: WorkerId, block: int) -> bool:
        """Whether ``worker`` holds ``block`` in any tier."""
        return any(block in self._held[t].get(worker, ()) for t in TIERS)

    def match(self, hashes: Sequence[int], tier: Tier = "GPU",
              workers: Iterable[WorkerId] | None = None) -> dict[WorkerId, int]:
        """Longest cached prefix, in blocks, of ``hashes`` on each worker (absent: 0)."""
        held = self._held[tier]
        out: dict[WorkerId, int] = {}
        for w in held if workers is None else workers:
            s = held.get(w)
            if s:
                d = _depth(s, hashes)
                if d:
                    out[w] = d
        return out

    def snapshot(self) -> Mapping[WorkerId, Mapping[Tier, int]]:
        return {w: {t: len(self._held[t].get(w, ())) for t in TIERS} for w in self._held["GPU"]}
