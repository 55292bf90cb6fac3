"""One model's slots on one replica: which tenant holds how many, who waits for one, and who is let in
next. Pure: time is an argument, no I/O, no asyncio (the gate wraps it with futures; the tenants
benchmark drives it in virtual time).

The rules, in order:

- **Capacity** is given by the caller at every step (the model's free engine slots change as workers
  come and go and as other replicas' requests come and go; ``None``: no limit known, nobody waits).
- **Fair share.** While other tenants are active, a tenant holds at most its weighted share of the
  capacity: ``capacity × weight / (sum of the active tenants' weights)``, itself included; alone it may
  hold all of it. A tenant is active while it holds or waits for a slot and for ``share_window_s`` after
  its last request arrived, so a tenant between two requests of a conversation keeps its share. What a
  heavy tenant may not take stays free for the others' bursts: that headroom is what keeps a light
  tenant's time to first token near its solo value (``kvgate bench tenants``). ``share_window_s=None``
  turns the rule off: any free slot goes to whoever is next.
- **Order.** Interactive requests go before batch ones; within a class, the waiting tenant that holds
  the fewest slots for its weight (max-min fairness over what is held now, not over departures), then
  the one whose head has waited longest; within a tenant, first come first served.
- **Bound.** At most ``queue_size`` requests wait, all tenants together.

Invariant: ``sum(held) == busy``; a tenant with nothing held, nothing waiting and no recent arrival is
forgotten (the pool's size is bounded by the tenants active in the window, not by every tenant seen).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from kvgate.admission.settings import Priority

T = TypeVar("T")
CLASSES: tuple[Priority, ...] = ("interactive", "batch")


@dataclass(slots=True)
class _Tenant(Generic[T]):
    weight: float
    held: int = 0
    seen: float = -math.inf
    """When its last request arrived."""
    waiting: dict[Priority, deque[tuple[int, T]]] = field(default_factory=lambda: {c: deque() for c in CLASSES})

    def queued(self) -> int:
        return sum(len(q) for q in self.waiting.values())


class SlotPool(Generic[T]):
    def __init__(self, queue_size: int, share_window_s: float | None = None) -> None:
        self.queue_size = queue_size
        self.share_window_s = share_window_s
        self._tenants: dict[str, _Tenant[T]] = {}
        self._queued = 0
        self._seq = 0
        self._ops = 0
        self.busy = 0

    def __len__(self) -> int:
        """Requests waiting."""
        return self._queued

    @property
    def full(self) -> bool:
        return self._queued >= self.queue_size

    def held(self, tenant: str) -> int:
        t = self._tenants.get(tenant)
        return 0 if t is None else t.held

    # -- the share rule ----------------------------------------------------------------------------
    def _active(self, t: _Tenant[T], now: float) -> bool:
        w = self.share_window_s
        return t.held > 0 or t.queued() > 0 or (w is not None and now - t.seen <= w)

    def share(self, tenant: str, capacity: int, now: float) -> float:
        """The slots ``tenant`` may hold now (all of ``capacity`` when the rule is off or it is alone)."""
        me = self._tenants.get(tenant)
        if self.share_window_s is None or me is None:
            return float(capacity)
        total = sum(t.weight for t in self._tenants.values() if t is me or self._active(t, now))
        return capacity * me.weight / total

    def _may_hold_more(self, name: str, t: _Tenant[T], capacity: int, now: float) -> bool:
        return t.held < max(1.0, self.share(name, capacity, now))

    # -- requests ----------------------------------------------------------------------------------
    def arrive(self, tenant: str, weight: float, now: float) -> None:
        """A request of ``tenant`` arrived (it counts as active from now, whatever happens to it)."""
        t = self._tenants.get(tenant)
        if t is None:
            t = self._tenants[tenant] = _Tenant(weight)
        t.weight, t.seen = weight, now

    def try_take(self, tenant: str, priority: Priority, capacity: int | None, now: float) -> bool:
        """A slot at once, if one is free, the tenant may hold another, and nobody who would go first waits."""
        t = self._tenants[tenant]
        if capacity is None:
            t.held += 1
            self.busy += 1
            return True
        if self.busy >= capacity or not self._may_hold_more(tenant, t, capacity, now):
            return False
        others = ((n, o) for n, o in self._tenants.items() if o is not t)
        if any(self._precedes(o, n, t, priority, capacity, now) for n, o in others):
            return False
        if t.waiting[priority] or (priority == "batch" and t.waiting["interactive"]):
            return False  # its own earlier requests go first
        t.held += 1
        self.busy += 1
        return True

    def _precedes(self, o: _Tenant[T], oname: str, t: _Tenant[T], priority: Priority, capacity: int,
                  now: float) -> bool:
        """Does a request of ``o`` that waits go before a new one of ``t``?"""
        for c in CLASSES:
            if o.waiting[c] and self._may_hold_more(oname, o, capacity, now):
                if c != priority:
                    return c == "interactive"
                return o.held / o.weight <= t.held / t.weight
        return False

    def push(self, tenant: str, priority: Priority, item: T) -> bool:
        """Wait for a slot; False when the queue is full (the caller answers 503)."""
        if self.full:
            return False
        self._seq += 1
        self._tenants[tenant].waiting[priority].append((self._seq, item))
        self._queued += 1
        return True

    def grant(self, capacity: int | None, now: float) -> list[T]:
        """The waiters that take a slot now, in order (each now holds one)."""
        out: list[T] = []
        while capacity is None or self.busy < capacity:
            nxt = self._next(capacity, now)
            if nxt is None:
                break
            name, c = nxt
            t = self._tenants[name]
            _, item = t.waiting[c].popleft()
            self._queued -= 1
            t.held += 1
            self.busy += 1
            out.append(item)
        return out

    def _next(self, capacity: int | None, now: float) -> tuple[str, Priority] | None:
        for c in CLASSES:
            best: tuple[float, int, str] | None = None
            for name, t in self._tenants.items():
                q = t.waiting[c]
                if not q or (capacity is not None and not self._may_hold_more(name, t, capacity, now)):
                    continue
                key = (t.held / t.weight, q[0][0], name)
                if best is None or key < best:
                    best = key
            if best is not None:
                return best[2], c
        return None

    def release(self, tenant: str, now: float) -> None:
        """A request of ``tenant`` ended: its slot is free (``grant`` says who takes it)."""
        t = self._tenants[tenant]
        assert t.held > 0, f"tenant {tenant!r} releases a slot it does not hold"
        t.held -= 1
        self.busy -= 1
        self._forget(tenant, t, now)

    def remove(self, tenant: str, item: T, now: float) -> bool:
        """Take a waiting ``item`` out (its request gave up); False if it is not waiting (granted already)."""
        t = self._tenants.get(tenant)
        if t is None:
            return False
        for q in t.waiting.values():
            for entry in q:
                if entry[1] is item:
                    q.remove(entry)
                    self._queued -= 1
                    self._forget(tenant, t, now)
                    return True
        return False

    def _forget(self, name: str, t: _Tenant[T], now: float) -> None:
        if not self._active(t, now):
            del self._tenants[name]
        self._ops += 1
        if self._ops % 256 == 0:  # the others that went quiet since, now and then (amortised O(1))
            for n in [n for n, o in self._tenants.items() if not self._active(o, now)]:
                del self._tenants[n]

    def tenants(self) -> int:
        return len(self._tenants)
