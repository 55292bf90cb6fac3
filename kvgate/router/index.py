"""Where each KV block lives: block hash → the workers holding it, per tier.

Hashes are the 64-bit ints KV events carry. Workers are bits of an int mask, so a lookup walks the
request's block hashes once, AND-ing masks: ``match`` costs time proportional to the blocks matched
(it stops when no worker holds the next block), not to the fleet or the index size.

Invariants:
- ``_masks[tier][h]`` has bit ``b`` set iff ``h in _held[tier][worker with bit b]``;
- an entry whose mask becomes 0 is deleted, so the index holds only blocks someone holds.
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


class PrefixIndex:
    def __init__(self) -> None:
        self._bits: dict[WorkerId, int] = {}
        self._free_bits: list[int] = []
        self._masks: dict[Tier, dict[int, int]] = {t: {} for t in TIERS}
        self._held: dict[Tier, dict[WorkerId, set[int]]] = {t: {} for t in TIERS}

    # -- workers ---------------------------------------------------------------------------------
    def _bit(self, worker: WorkerId) -> int:
        b = self._bits.get(worker)
        if b is None:
            b = self._free_bits.pop() if self._free_bits else len(self._bits)
            self._bits[worker] = b
            for t in TIERS:
                self._held[t][worker] = set()
        return b

    def workers(self) -> list[WorkerId]:
        return list(self._bits)

    def block_count(self, worker: WorkerId | None = None, tier: Tier = "GPU") -> int:
        if worker is None:
            return len(self._masks[tier])
        return len(self._held[tier].get(worker, ()))

    # -- updates ---------------------------------------------------------------------------------
    def store(self, worker: WorkerId, hashes: Iterable[int], tier: Tier = "GPU") -> None:
        flag = 1 << self._bit(worker)
        masks = self._masks[tier]
        held = self._held[tier][worker]
        for h in hashes:
            masks[h] = masks.get(h, 0) | flag
            held.add(h)

    def remove(self, worker: WorkerId, hashes: Iterable[int], tier: Tier = "GPU") -> int:
        """Drop blocks; returns how many were actually held (unknown ones are ignored)."""
        b = self._bits.get(worker)
        if b is None:
            return 0
        keep = ~(1 << b)
        masks = self._masks[tier]
        held = self._held[tier][worker]
        n = 0
        for h in hashes:
            if h in held:
                held.discard(h)
                m = masks[h] & keep
                if m:
                    masks[h] = m
                else:
                    del masks[h]
                n += 1
        return n

    def clear(self, worker: WorkerId, tier: Tier | None = None) -> int:
        """Forget everything a worker holds (AllBlocksCleared, an event gap, a worker gone)."""
        n = 0
        for t in (tier,) if tier else TIERS:
            held = self._held[t].get(worker)
            if held:
                n += self.remove(worker, list(held), t)
        return n

    def drop_worker(self, worker: WorkerId) -> None:
        self.clear(worker)
        b = self._bits.pop(worker, None)
        if b is not None:
            self._free_bits.append(b)
            for t in TIERS:
                self._held[t].pop(worker, None)

    # -- lookups ---------------------------------------------------------------------------------
    def match(self, hashes: Sequence[int], tier: Tier = "GPU",
              workers: Iterable[WorkerId] | None = None) -> dict[WorkerId, int]:
        """Longest cached prefix, in blocks, of ``hashes`` on each worker (absent: 0)."""
        bits = self._bits if workers is None else {w: self._bits[w] for w in workers if w in self._bits}
        if not bits or not hashes:
            return {}
        alive = 0
        for b in bits.values():
            alive |= 1 << b
        masks = self._masks[tier]
        depth_by_bit: dict[int, int] = {}
        for i, h in enumerate(hashes):
            m = masks.get(h, 0) & alive
            if m != alive:
                gone = alive & ~m
                while gone:
                    low = gone & -gone
                    depth_by_bit[low.bit_length() - 1] = i
                    gone ^= low
                alive = m
                if not alive:
                    break
        while alive:  # workers that hold the whole sequence
            low = alive & -alive
            depth_by_bit[low.bit_length() - 1] = len(hashes)
            alive ^= low
        return {w: depth_by_bit.get(b, 0) for w, b in bits.items() if depth_by_bit.get(b, 0) > 0}

    def snapshot(self) -> Mapping[WorkerId, Mapping[Tier, int]]:
        return {w: {t: len(self._held[t][w]) for t in TIERS} for w in self._bits}
