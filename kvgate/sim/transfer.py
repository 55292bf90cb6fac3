"""One engine's transfer channel for asynchronous tier loads: the host-to-device copy (PCIe) and the
NIC a pool load comes over, as one path that moves one load at a time, first come first served.

Serialised rather than bandwidth-shared: the tier rates (``sim/tiers.py``) are what one load gets from
the whole link, so two loads at once would each take twice as long and the later one would finish
no sooner than after both — FIFO finishes the first one earlier and the second at the same time. LMCache's
``async_loading`` also bounds the retrievals in flight (a weighted semaphore over its allocator budget,
``docs/kv_cache/async_loading`` in LMCache), so loads of one engine do queue there.

No clock: the engine ``advance``s the channel by each step's duration, since a load runs while the
batch steps.
"""

from __future__ import annotations

from collections import deque
from typing import Generic, TypeVar

T = TypeVar("T")


class TransferChannel(Generic[T]):
    def __init__(self) -> None:
        self._queue: deque[tuple[T, float]] = deque()
        """(what is loaded, ms of transfer left); only the head is moving."""

    def __len__(self) -> int:
        return len(self._queue)

    def __contains__(self, item: object) -> bool:
        return any(x is item for x, _ in self._queue)

    def submit(self, item: T, ms: float) -> None:
        self._queue.append((item, max(0.0, ms)))

    def backlog_ms(self) -> float:
        """How long a load submitted now waits before its own transfer starts."""
        return sum(ms for _, ms in self._queue)

    def head_ms(self) -> float:
        """Until the next load finishes (inf when none is pending)."""
        return self._queue[0][1] if self._queue else float("inf")

    def advance(self, ms: float) -> list[T]:
        """``ms`` of transfer time pass; returns the loads that finished, in order."""
        done: list[T] = []
        left = ms
        while self._queue and self._queue[0][1] <= left:
            item, need = self._queue.popleft()
            left -= need
            done.append(item)
        if self._queue and left > 0:
            item, need = self._queue[0]
            self._queue[0] = (item, need - left)
        return done

    def cancel(self, item: T) -> bool:
        for i, (x, _) in enumerate(self._queue):
            if x is item:
                del self._queue[i]
                return True
        return False
