"""The tenant budgets of the session controller's background work (issue 11, docs/admission.md): KV
parked on workers while tools run (``max_parked_kv_tokens``) and background-prefill tokens per minute
(``prefill_tokens_per_minute``).

An adapter: it reads a tenant's limits and asks the stores what is left, and the session controller
decides on those numbers (``session/controller.py``, which stays pure). Where the state lives:

- parked KV: the fleet store's reservations, each with its tenant (``kvstore/fleet.py``); the store's
  ``reserve`` checks the budget again and writes in one step, so replicas reserving at once cannot
  overshoot it together;
- background prefill: the quota store's ``prefill`` bucket (``admission/store.py``), peeked before a
  decision and charged a prefill's gain when it is issued (a forced charge: two replicas deciding at
  once may each issue one, and the debt delays the tenant's next ones).

Both are shared by every replica when their stores are (Redis), else per replica. A store that fails
leaves the budget unknown, and the work goes on as if there were none: as admission admits unmetered
when its store is down, background work is not stopped for the whole fleet by a store outage.
"""

from __future__ import annotations

import logging

from kvgate.admission.settings import AdmissionSettings, TenantLimits
from kvgate.admission.store import QuotaStore, QuotaStoreError
from kvgate.kvstore.conversations import StoreError
from kvgate.kvstore.fleet import FleetStore

log = logging.getLogger(__name__)


class TenantBudgets:
    def __init__(self, settings: AdmissionSettings, quotas: QuotaStore, fleet: FleetStore) -> None:
        self.settings = settings
        self.quotas = quotas
        self.fleet = fleet

    def _limits(self, tenant: str) -> TenantLimits | None:
        # Off, no tenant limit applies (admission's own rule).
        return self.settings.limits_for(tenant) if self.settings.enabled else None

    def parked_limit(self, tenant: str) -> int | None:
        limits = self._limits(tenant)
        return None if limits is None else limits.max_parked_kv_tokens

    async def parked_left(self, tenant: str, now: float) -> int | None:
        """KV tokens the tenant may still park (None: no budget, or the fleet store did not answer)."""
        limit = self.parked_limit(tenant)
        if limit is None:
            return None
        try:
            return max(0, limit - await self.fleet.reserved_by(tenant, now))
        except StoreError as exc:
            # The store's own check at reserve time still holds, if the store is back by then.
            log.warning("parked KV of tenant %r unknown: %s", tenant, exc)
            return None

    def prefill_rate(self, tenant: str) -> int | None:
        limits = self._limits(tenant)
        return None if limits is None else limits.prefill_tokens_per_minute

    async def prefill_left(self, tenant: str) -> float | None:
        """Background-prefill tokens the tenant has left now (negative: in debt; None: no budget, or the
        quota store did not answer)."""
        rate = self.prefill_rate(tenant)
        if rate is None:
            return None
        try:
            return await self.quotas.level(tenant, "prefill", rate)
        except QuotaStoreError as exc:
            log.warning("prefill budget of tenant %r unknown: %s", tenant, exc)
            return None

    async def charge_prefill(self, tenant: str, tokens: int) -> None:
        rate = self.prefill_rate(tenant)
        if rate is None:
            return
        try:
            await self.quotas.charge(tenant, "prefill", rate, tokens)
        except QuotaStoreError as exc:
            log.warning("prefill of tenant %r not charged: %s", tenant, exc)
