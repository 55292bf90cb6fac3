"""Where tenants' quota state lives: the interface, and the in-memory store (one process's state, for a
single replica or no Redis)."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Protocol

from kvgate.admission.quota import Quota, TenantState, Verdict, admit, release, renew


class QuotaStore(Protocol):
    async def admit(self, tenant: str, quota: Quota, tokens: int, lease: str, lease_ttl_s: float) -> Verdict: ...

    async def release(self, tenant: str, lease: str) -> None: ...

    async def renew(self, held: Mapping[str, set[str]], lease_ttl_s: float) -> None:
        """Extend the leases this replica holds (tenant -> lease ids)."""

    async def close(self) -> None: ...


class QuotaStoreError(Exception):
    """The shared store failed; the gate then admits (availability over enforcement, docs/admission.md)."""


class MemoryQuotaStore:
    def __init__(self, now: Callable[[], float] = time.monotonic) -> None:
        self._now = now
        self._tenants: dict[str, TenantState] = {}

    async def admit(self, tenant: str, quota: Quota, tokens: int, lease: str, lease_ttl_s: float) -> Verdict:
        state, verdict = admit(self._tenants.get(tenant, TenantState()), quota, self._now(), tokens, lease,
                               lease_ttl_s)
        self._tenants[tenant] = state
        return verdict

    async def release(self, tenant: str, lease: str) -> None:
        s = self._tenants.get(tenant)
        if s is not None:
            self._tenants[tenant] = release(s, lease)

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
