"""A bounded queue shared by tenants: interactive requests leave before batch ones, and within a class the
tenants waiting share departures in proportion to their weights (stride scheduling).

Each tenant has a ``pass``; the waiting tenant with the lowest pass goes next and its pass grows by
1/weight. A tenant that starts waiting again joins at the current virtual time (the last departure's
pass), so a tenant that was idle cannot bank a burst ahead of the others. Pure: no clock, no I/O."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from kvgate.admission.settings import Priority

T = TypeVar("T")
CLASSES: tuple[Priority, ...] = ("interactive", "batch")


@dataclass
class _Tenant(Generic[T]):
    weight: float
    pass_: float = 0.0
    waiting: dict[Priority, deque[tuple[int, T]]] = field(
        default_factory=lambda: {c: deque() for c in CLASSES})


class FairQueue(Generic[T]):
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._tenants: dict[str, _Tenant[T]] = {}
        self._size = 0
        self._vtime = 0.0
        self._seq = 0

    def __len__(self) -> int:
        return self._size

    @property
    def full(self) -> bool:
        return self._size >= self.capacity

    def push(self, tenant: str, weight: float, priority: Priority, item: T) -> bool:
        """Queue ``item``; False when the queue is full (the caller answers 503)."""
        if self.full:
            return False
        t = self._tenants.get(tenant)
        if t is None:
            t = self._tenants[tenant] = _Tenant(weight, self._vtime)
        elif not any(t.waiting.values()):
            t.pass_ = max(t.pass_, self._vtime)
        t.weight = weight
        self._seq += 1
        t.waiting[priority].append((self._seq, item))
        self._size += 1
        return True

    def pop(self) -> T | None:
        """The next item: the highest class with anyone waiting, the lowest pass (then the oldest) in it."""
        for c in CLASSES:
            best: tuple[float, int, str] | None = None
            for name, t in self._tenants.items():
                q = t.waiting[c]
                if q and (best is None or (t.pass_, q[0][0]) < best[:2]):
                    best = (t.pass_, q[0][0], name)
            if best is not None:
                t = self._tenants[best[2]]
                _, item = t.waiting[c].popleft()
                self._size -= 1
                self._vtime = t.pass_
                t.pass_ += 1.0 / t.weight
                self._forget_idle()
                return item
        return None

    def remove(self, tenant: str, item: T) -> bool:
        """Take ``item`` out (its request gave up); False if it is not queued (already popped)."""
        t = self._tenants.get(tenant)
        if t is None:
            return False
        for q in t.waiting.values():
            for entry in q:
                if entry[1] is item:
                    q.remove(entry)
                    self._size -= 1
                    self._forget_idle()
                    return True
        return False

    def _forget_idle(self) -> None:
        # Bounded by the tenants waiting, not by every tenant ever seen; an idle tenant's pass is behind
        # the virtual time anyway, so forgetting it changes nothing.
        for name in [n for n, t in self._tenants.items() if not any(t.waiting.values()) and t.pass_ <= self._vtime]:
            del self._tenants[name]
