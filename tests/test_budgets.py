"""The tenant budgets the session runtime applies (``admission/budgets.py``): what is left of each, read
from the real stores; nothing with admission off; unknown (so unlimited) when a store is down."""

from __future__ import annotations

from kvgate.admission.budgets import TenantBudgets
from kvgate.admission.redis_store import RedisQuotaStore
from kvgate.admission.settings import AdmissionSettings, TenantLimits
from kvgate.admission.store import MemoryQuotaStore
from kvgate.kvstore.fleet import MemoryFleet
from kvgate.kvstore.redis_fleet import RedisFleet
from kvgate.router.types import ConversationId, WorkerId
from tests.conftest import free_port

W = WorkerId("w0")
SETTINGS = AdmissionSettings(enabled=True, defaults=TenantLimits(max_parked_kv_tokens=1000),
                             tenants={"big": TenantLimits(max_parked_kv_tokens=5000, prefill_tokens_per_minute=300)})


async def test_parked_kv_left_is_the_budget_less_the_tenants_live_reservations() -> None:
    fleet = MemoryFleet()
    b = TenantBudgets(SETTINGS, MemoryQuotaStore(), fleet)
    await fleet.reserve(W, ConversationId("a/1"), 600, until=10.0, tenant="a", now=0.0)
    await fleet.reserve(W, ConversationId("big/1"), 600, until=10.0, tenant="big", now=0.0)
    assert await b.parked_left("a", 5.0) == 400 and await b.parked_left("big", 5.0) == 4400
    assert await b.parked_left("a", 10.0) == 1000  # its deadline passed
    await fleet.reserve(W, ConversationId("a/2"), 1500, until=20.0, tenant="a", now=10.0)  # no budget given
    assert await b.parked_left("a", 10.0) == 0  # over it (an older replica wrote it): nothing left, not less


async def test_prefill_left_is_the_tenants_bucket_and_a_charge_takes_from_it() -> None:
    quotas = MemoryQuotaStore(now=lambda: 0.0)  # a clock that stands still: no refill between the steps
    b = TenantBudgets(SETTINGS, quotas, MemoryFleet())
    assert b.prefill_rate("big") == 300 and await b.prefill_left("big") == 300
    await b.charge_prefill("big", 256)
    assert await b.prefill_left("big") == 44
    await b.charge_prefill("big", 256)
    assert await b.prefill_left("big") == -212  # a forced charge: in debt, the next prefills wait
    assert b.prefill_rate("a") is None and await b.prefill_left("a") is None  # no prefill budget
    await b.charge_prefill("a", 256)
    assert quotas.tenants() == 1  # nothing kept for a tenant without one


async def test_admission_off_means_no_budgets() -> None:
    b = TenantBudgets(SETTINGS.model_copy(update={"enabled": False}), MemoryQuotaStore(), MemoryFleet())
    assert b.parked_limit("a") is None and await b.parked_left("a", 0.0) is None
    assert await b.prefill_left("big") is None


async def test_a_store_that_is_down_leaves_the_budgets_unknown() -> None:
    dead = f"redis://127.0.0.1:{free_port()}/0"
    quotas, fleet = RedisQuotaStore(dead), RedisFleet(dead)
    try:
        b = TenantBudgets(SETTINGS, quotas, fleet)
        assert await b.parked_left("a", 0.0) is None  # the fleet store's own check still applies at reserve
        assert await b.prefill_left("big") is None
        await b.charge_prefill("big", 256)  # logged, not raised: the prefill is advisory work
    finally:
        await quotas.close()
        await fleet.close()
