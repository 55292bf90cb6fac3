"""Where tenants' quota state lives: the interface, and the in-memory store (one process's state, for a
single replica or no Redis)."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Protocol

from kvgate.admission.quota import BucketName, Quota, TenantState, Verdict, admit, charge, level, release, renew


class QuotaStore(Protocol):
    async def admit(self, tenant: str, quota: Quota, tokens: int, lease: str, lease_ttl_s: float) -> Verdict: ...

    async def release(self, tenant: str, lease: str) -> None: ...

    async def charge(self, tenant: str, bucket: BucketName, per_minute: int, amount: float) -> None:
        """Take ``amount`` from a bucket whatever it holds (``quota.charge``)."""

    async def level(self, tenant: str, bucket: BucketName, per_minute: int) -> float:
        """What a bucket holds now (a full one when the tenant has none yet)."""
        ...

    async def renew(self, held: Mapping[str, set[str]], lease_ttl_s: float) -> None:
        """Extend the leases this replica holds (tenant -> lease ids)."""

    async def close(self) -> None: ...


class QuotaStoreError(Exception):
    """The shared store failed; the gate then admits (availability over enforcement, docs/admission.md)."""


IDLE_S = 120.0
"""A tenant untouched this long, holding no lease, has full buckets again (a minute refills one, and a debt
is at most a minute's worth): its state is the same as none."""


class MemoryQuotaStore:
    def __init__(self, now: Callable[[], float] = time.monotonic, sweep_every: int = 1024) -> None:
        self._now = now
        self._tenants: dict[str, TenantState] = {}
        self._touched: dict[str, float] = {}
        self._ops = 0
        self._sweep_every = sweep_every

    def _put(self, tenant: str, state: TenantState) -> None:
        # Tenants are as many as clients name (the tenant header, with auth off): forget the idle ones.
        now = self._now()
        self._tenants[tenant] = state
        self._touched[tenant] = now
        self._ops += 1
        if self._ops % self._sweep_every == 0:
            for t in [t for t, at in self._touched.items()
                      if now - at > IDLE_S and not any(v > now for v in self._tenants[t].leases.values())]:
                del self._tenants[t], self._touched[t]

    def tenants(self) -> int:
        return len(self._tenants)

    async def admit(self, tenant: str, quota: Quota, tokens: int, lease: str, lease_ttl_s: float) -> Verdict:
        state, verdict = admit(self._tenants.get(tenant, TenantState()), quota, self._now(), tokens, lease,
                               lease_ttl_s)
        self._put(tenant, state)
        return verdict

    async def release(self, tenant: str, lease: str) -> None:
        s = self._tenants.get(tenant)
        if s is not None:
            self._tenants[tenant] = release(s, lease)

    async def charge(self, tenant: str, bucket: BucketName, per_minute: int, amount: float) -> None:
        self._put(tenant, charge(self._tenants.get(tenant, TenantState()), bucket, per_minute, self._now(), amount))

    async def level(self, tenant: str, bucket: BucketName, per_minute: int) -> float:
        return level(self._tenants.get(tenant, TenantState()), bucket, per_minute, self._now())

    async def renew(self, held: Mapping[str, set[str]], lease_ttl_s: float) -> None:
        until = self._now() + lease_ttl_s
        for tenant, leases in held.items():
            s = self._tenants.get(tenant)
            if s is not None:
                self._tenants[tenant] = renew(s, leases, until)

    def leases(self, tenant: str) -> int:
        s = self._tenants.get(tenant)
        return 0 if s is None else sum(1 for v in s.leases.values() if v > self._now())

    async def close(self) -> None:
        return None
