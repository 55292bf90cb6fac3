"""What the gateway replicas share besides conversation records: timers, learned statistics and KV
reservations. In memory for one replica; in Redis for many (``kvstore/redis_fleet.py``).

- **Timers** (reservation lapse, prefetch, settle, prefill) are owned fleet-wide: a due timer is
  *claimed* by exactly one replica, which holds a lease on it until it reports it ``done``; a replica
  that dies before that loses the lease and another replica claims the timer again. One timer per
  (conversation, kind); arming replaces, and a token tells a stale firing from the current one.
- **Observations** (a tool wait measured, a user who came back or did not) are published once and read
  by every replica in the same order, so every replica's ``Learned`` statistics converge; a replica that
  starts reads the ones still kept, so it starts warm.
- **Reservations**: the KV tokens parked on each worker for short tool waits, each with its deadline,
  so a reservation nobody released (its replica died) still ends, and its tenant, so a tenant's parked
  KV is known fleet-wide and its budget (``max_parked_kv_tokens``) holds even when replicas reserve at
  the same moment: ``reserve`` checks and writes in one step.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from dataclasses import dataclass
from typing import Protocol

from kvgate.kvstore.corrupt import Corruption
from kvgate.router.types import ConversationId, WorkerId
from kvgate.session.state import Observation


@dataclass(frozen=True, slots=True)
class _Parked:
    tokens: int
    until: float
    tenant: str


@dataclass(frozen=True, slots=True)
class Timer:
    conversation: ConversationId
    kind: str
    token: int


class FleetStore(Protocol):
    async def arm(self, cid: ConversationId, kind: str, due: float, token: int) -> None: ...

    async def cancel(self, cid: ConversationId, kinds: tuple[str, ...]) -> None: ...

    async def claim(self, now: float, lease_s: float, limit: int = 64) -> list[Timer]:
        """Due timers, each claimed by this caller alone until ``now + lease_s``."""
        ...

    async def renew(self, timer: Timer, until: float) -> None:
        """Still running the claimed timer: keep the lease until ``until`` (unless it was re-armed)."""
        ...

    async def done(self, timer: Timer) -> None:
        """The claimed timer ran: drop it (unless it was re-armed meanwhile)."""
        ...

    async def publish(self, obs: Observation) -> None: ...

    async def observations(self) -> list[Observation]:
        """Observations published (by any replica) since this caller's last read, oldest first."""
        ...

    async def reserve(self, worker: WorkerId, cid: ConversationId, tokens: int, until: float, *, tenant: str,
                      now: float, budget: int | None = None) -> bool:
        """Park ``tokens`` of ``cid`` (a conversation of ``tenant``) on ``worker`` until ``until``. With a
        budget: refused (False, nothing written) when the tenant's reservations live at ``now``, the one it
        replaces (same worker and conversation) left out, plus ``tokens`` would exceed it."""
        ...

    async def unreserve(self, worker: WorkerId, cid: ConversationId, *, tenant: str) -> None: ...

    async def reserved(self, now: float) -> dict[WorkerId, int]:
        """Tokens reserved per worker, counting reservations whose deadline has not passed."""
        ...

    async def reserved_by(self, tenant: str, now: float) -> int:
        """Tokens the tenant's conversations hold reserved, on all workers, whose deadline has not passed."""
        ...

    async def close(self) -> None: ...

    @property
    def corruption(self) -> Corruption:
        """The corrupt values this store found (none in memory: nobody else writes it)."""
        ...


class MemoryFleet:
    """One replica's fleet state (single replica, tests, virtual-time drivers)."""

    def __init__(self) -> None:
        self._timers: dict[tuple[ConversationId, str], tuple[float, int]] = {}
        self._heap: list[tuple[float, ConversationId, str]] = []
        self._obs: list[Observation] = []
        self.corruption = Corruption()
        self._reserved: dict[WorkerId, dict[ConversationId, _Parked]] = defaultdict(dict)
        self._tenants: dict[str, dict[tuple[WorkerId, ConversationId], _Parked]] = defaultdict(dict)
        """The same reservations by tenant: a budget check reads only its tenant's."""

    async def arm(self, cid: ConversationId, kind: str, due: float, token: int) -> None:
        self._timers[(cid, kind)] = (due, token)
        heapq.heappush(self._heap, (due, cid, kind))

    async def cancel(self, cid: ConversationId, kinds: tuple[str, ...]) -> None:
        for k in kinds:
            self._timers.pop((cid, k), None)

    async def claim(self, now: float, lease_s: float, limit: int = 64) -> list[Timer]:
        out: list[Timer] = []
        while self._heap and self._heap[0][0] <= now and len(out) < limit:
            due, cid, kind = heapq.heappop(self._heap)
            cur = self._timers.get((cid, kind))
            if cur is None or cur[0] != due:
                continue  # cancelled or re-armed: that entry is stale
            self._timers[(cid, kind)] = (now + lease_s, cur[1])
            heapq.heappush(self._heap, (now + lease_s, cid, kind))
            out.append(Timer(cid, kind, cur[1]))
        return out

    async def renew(self, timer: Timer, until: float) -> None:
        cur = self._timers.get((timer.conversation, timer.kind))
        if cur is not None and cur[1] == timer.token:
            self._timers[(timer.conversation, timer.kind)] = (until, cur[1])
            heapq.heappush(self._heap, (until, timer.conversation, timer.kind))

    async def done(self, timer: Timer) -> None:
        cur = self._timers.get((timer.conversation, timer.kind))
        if cur is not None and cur[1] == timer.token:
            del self._timers[(timer.conversation, timer.kind)]

    async def publish(self, obs: Observation) -> None:
        self._obs.append(obs)

    async def observations(self) -> list[Observation]:
        out, self._obs = self._obs, []
        return out

    async def reserve(self, worker: WorkerId, cid: ConversationId, tokens: int, until: float, *, tenant: str,
                      now: float, budget: int | None = None) -> bool:
        if budget is not None:
            held = self._tenants.get(tenant, {})
            others = sum(p.tokens for k, p in held.items() if p.until > now and k != (worker, cid))
            if others + tokens > budget:
                return False
        self._drop(worker, cid)  # replaced: out of its tenant's index too
        p = _Parked(tokens, until, tenant)
        self._reserved[worker][cid] = p
        self._tenants[tenant][(worker, cid)] = p
        return True

    async def unreserve(self, worker: WorkerId, cid: ConversationId, *, tenant: str) -> None:
        self._drop(worker, cid)

    def _drop(self, worker: WorkerId, cid: ConversationId) -> None:
        p = self._reserved[worker].pop(cid, None)
        if p is None:
            return
        held = self._tenants.get(p.tenant)
        if held is not None:
            held.pop((worker, cid), None)
            if not held:
                del self._tenants[p.tenant]

    async def reserved(self, now: float) -> dict[WorkerId, int]:
        out: dict[WorkerId, int] = {}
        for w, held in self._reserved.items():
            for cid in [c for c, p in held.items() if p.until <= now]:
                self._drop(w, cid)
            out[w] = sum(p.tokens for p in held.values())
        return out

    async def reserved_by(self, tenant: str, now: float) -> int:
        return sum(p.tokens for p in self._tenants.get(tenant, {}).values() if p.until > now)

    async def close(self) -> None:
        return None
