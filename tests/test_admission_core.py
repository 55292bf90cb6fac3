"""Admission's pure cores (issue 11 part 3): the token bucket, the quota check, the weighted-fair queue,
the gate's slots; and the Redis store's script against the memory store's core."""

from __future__ import annotations

import asyncio
import math
import uuid
from collections import Counter
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from kvgate.admission.bucket import Bucket, Rate, refill, wait_s
from kvgate.admission.capacity import SlotEstimate, foreign, free_slots, learn_slots, model_capacity
from kvgate.admission.gate import Admission, RateLimited, parse_priority
from kvgate.admission.quota import (
    Quota,
    TenantState,
    admit,
    charge,
    duration,
    level,
    ratelimit_headers,
    release,
    renew,
    retry_after_header,
)
from kvgate.admission.redis_store import RedisQuotaStore
from kvgate.admission.settings import AdmissionSettings, TenantLimits
from kvgate.admission.slots import SlotPool
from kvgate.admission.store import MemoryQuotaStore
from kvgate.errors import BadRequest, ServiceUnavailable

REDIS = "redis://127.0.0.1:6379/0"


def test_bucket_starts_full_refills_at_its_rate_and_caps() -> None:
    r = Rate(60)  # one a second
    b = refill(None, r, 100.0)
    assert b == Bucket(60.0, 100.0)
    b = Bucket(0.0, 100.0)
    assert refill(b, r, 110.0).level == pytest.approx(10.0)
    assert refill(b, r, 1000.0).level == 60.0  # at most a minute's worth
    assert refill(Bucket(5.0, 100.0), r, 90.0) == Bucket(5.0, 100.0)  # a clock that went back adds nothing
    assert wait_s(Bucket(0.5, 0.0), r, 1) == pytest.approx(0.5)
    assert wait_s(Bucket(3.0, 0.0), r, 2) == 0.0
    assert math.isinf(wait_s(Bucket(60.0, 0.0), r, 61))


def test_quota_is_all_or_nothing_and_says_when_to_retry() -> None:
    q = Quota(requests_per_minute=2, tokens_per_minute=100)
    s = TenantState()
    s, v = admit(s, q, 0.0, 60, "a", 30)
    assert v.ok
    s, v = admit(s, q, 0.0, 60, "b", 30)  # 40 tokens left: refused for tokens, and no request spent
    assert not v.ok and v.limit == "tokens_per_minute" and v.limit_value == 100
    assert v.retry_after_s == pytest.approx(20 * 60 / 100)
    assert s.requests is not None and s.requests.level == pytest.approx(1.0)
    s, v = admit(s, q, 0.0, 10, "c", 30)
    assert v.ok
    s, v = admit(s, q, 0.0, 1, "d", 30)
    assert not v.ok and v.limit == "requests_per_minute" and v.retry_after_s == pytest.approx(30.0)
    assert retry_after_header(v, 1) == "30"
    _, v = admit(TenantState(), q, 0.0, 101, "e", 30)  # larger than a minute's tokens: never
    assert not v.ok and v.retry_after_s == math.inf and retry_after_header(v, 1) is None


def test_an_admitted_request_says_what_its_limits_have_left() -> None:
    q = Quota(requests_per_minute=60, tokens_per_minute=600)
    _, v = admit(TenantState(), q, 0.0, 150, "a", 30)
    assert v.requests is not None and v.tokens is not None
    assert (v.requests.limit, v.requests.remaining, v.requests.reset_s) == (60, 59.0, pytest.approx(1.0))
    assert (v.tokens.remaining, v.tokens.reset_s) == (450.0, pytest.approx(15.0))
    assert ratelimit_headers(v) == {
        "x-ratelimit-limit-requests": "60", "x-ratelimit-remaining-requests": "59", "x-ratelimit-reset-requests": "1s",
        "x-ratelimit-limit-tokens": "600", "x-ratelimit-remaining-tokens": "450", "x-ratelimit-reset-tokens": "15s"}
    assert ratelimit_headers(admit(TenantState(), Quota(max_concurrent=2), 0.0, 1, "a", 30)[1]) == {}
    assert [duration(x) for x in (0.012, 1.0, 59.2, 360.0, 3723.0)] == ["12ms", "1s", "1m0s", "6m0s", "1h2m3s"]


def test_a_forced_charge_goes_into_debt_of_at_most_a_minute() -> None:
    s = charge(TenantState(), "tokens", 600, 0.0, 500)  # a completion of 500 tokens after the fact
    assert level(s, "tokens", 600, 0.0) == pytest.approx(100.0)
    s = charge(s, "tokens", 600, 0.0, 5000)
    assert level(s, "tokens", 600, 0.0) == pytest.approx(-600.0)  # the debt stops at a minute's worth
    assert level(s, "tokens", 600, 90.0) == pytest.approx(300.0)  # ... and is paid back at the rate
    _, v = admit(s, Quota(tokens_per_minute=600), 30.0, 10, "a", 30)  # in debt: refused until repaid
    assert not v.ok and v.retry_after_s == pytest.approx(31.0)  # -300 at 30 s: 310 tokens to go at 10/s
    p = charge(TenantState(), "prefill", 60, 0.0, 45)
    assert level(p, "prefill", 60, 0.0) == pytest.approx(15.0) and p.tokens is None  # buckets are apart


def test_concurrency_leases_release_and_expire() -> None:
    q = Quota(max_concurrent=2)
    s = TenantState()
    s, v1 = admit(s, q, 0.0, 1, "a", 30)
    s, v2 = admit(s, q, 0.0, 1, "b", 30)
    s, v3 = admit(s, q, 1.0, 1, "c", 30)
    assert v1.ok and v2.ok and not v3.ok and v3.limit == "max_concurrent" and v3.retry_after_s is None
    assert retry_after_header(v3, 2) == "2"
    s = release(s, "a")
    s, v = admit(s, q, 1.0, 1, "c", 30)
    assert v.ok
    s = renew(s, {"c"}, 100.0)  # "b" belongs to a replica that died: it is not renewed
    s, v = admit(s, q, 31.0, 1, "d", 30)
    assert v.ok and set(s.leases) == {"c", "d"}


def pool_of(cap_share: float | None = None, size: int = 100) -> SlotPool[str]:
    return SlotPool(size, cap_share)


def test_slots_go_to_the_tenant_holding_fewest_for_its_weight() -> None:
    p = pool_of()
    for name, w in (("heavy", 2.0), ("light", 1.0)):
        p.arrive(name, w, 0.0)
    for i in range(30):
        assert p.push("heavy", "interactive", f"h{i}") and p.push("light", "interactive", f"l{i}")
    granted = p.grant(30, 0.0)  # nothing ends meanwhile: held slots are what is compared
    assert Counter(x[0] for x in granted) == {"h": 20, "l": 10}
    assert p.held("heavy") == 20 and p.busy == 30
    assert p.grant(31, 0.0) == ["l10"]  # 20/2 == 10/1: the longest waiting head goes


def test_a_waiter_goes_before_a_newcomer_that_holds_more() -> None:
    p = pool_of()
    p.arrive("a", 1.0, 0.0)
    p.arrive("b", 1.0, 0.0)
    assert p.try_take("a", "interactive", 2, 0.0) and p.try_take("a", "interactive", 2, 0.0)
    assert not p.try_take("b", "interactive", 2, 0.0)  # full
    assert p.push("b", "interactive", "b0")
    p.release("a", 0.0)
    assert not p.try_take("a", "interactive", 2, 0.0)  # b waits and holds fewer: it goes first
    assert p.grant(2, 0.0) == ["b0"]


def test_interactive_first_then_fifo_per_tenant() -> None:
    p = pool_of()
    p.arrive("a", 1.0, 0.0)
    p.arrive("b", 1.0, 0.0)
    p.push("a", "batch", "a-batch-1")
    p.push("a", "batch", "a-batch-2")
    p.push("b", "interactive", "b-int-1")
    p.push("a", "interactive", "a-int-1")
    out = p.grant(4, 0.0)
    assert out[:2] in (["b-int-1", "a-int-1"], ["a-int-1", "b-int-1"])
    assert out[2:] == ["a-batch-1", "a-batch-2"]
    assert p.grant(5, 0.0) == [] and len(p) == 0


def test_the_queue_is_bounded_and_a_removed_waiter_is_gone() -> None:
    p = pool_of(size=3)
    p.arrive("a", 1.0, 0.0)
    items = [f"a{i}" for i in range(3)]
    assert all(p.push("a", "interactive", it) for it in items)
    assert p.full and not p.push("a", "interactive", "a3")
    assert p.remove("a", items[1], 0.0) and not p.remove("a", items[1], 0.0)  # by identity
    assert p.grant(10, 0.0) == ["a0", "a2"]


def test_a_heavy_tenant_keeps_to_its_share_while_a_light_one_is_active() -> None:
    p = pool_of(cap_share=10.0)
    p.arrive("heavy", 1.0, 0.0)
    assert sum(p.try_take("heavy", "interactive", 12, 0.0) for _ in range(12)) == 12  # alone: everything
    for _ in range(12):
        p.release("heavy", 1.0)
    p.arrive("light", 1.0, 1.0)  # light asks once, and is active for the window
    assert p.try_take("light", "interactive", 12, 1.0)
    p.release("light", 1.5)
    taken = sum(p.try_take("heavy", "interactive", 12, 2.0) for _ in range(12))
    assert taken == 6  # half of 12 while light is active, though light holds nothing right now
    assert p.share("heavy", 12, 2.0) == 6.0
    for _ in range(3):  # light's burst finds room
        assert p.try_take("light", "interactive", 12, 2.0)
    assert not p.try_take("heavy", "interactive", 12, 2.0)
    p.push("heavy", "interactive", "h-late")
    assert p.grant(12, 5.0) == []  # free slots, but heavy is at its share
    for _ in range(3):
        p.release("light", 11.0)
    assert p.grant(12, 11.5) == ["h-late"]  # light's window ran out: heavy may have all


def test_weights_divide_the_share() -> None:
    p = pool_of(cap_share=10.0)
    p.arrive("big", 3.0, 0.0)
    p.arrive("small", 1.0, 0.0)
    assert p.share("big", 12, 0.0) == 9.0 and p.share("small", 12, 0.0) == 3.0
    assert p.share("small", 2, 0.0) == 0.5 and p.try_take("small", "interactive", 2, 0.0)  # one slot at least


def test_no_capacity_known_means_nobody_waits_and_idle_tenants_are_forgotten() -> None:
    p = pool_of(cap_share=1.0)
    for i in range(3000):
        p.arrive(f"t{i}", 1.0, float(i))
        assert p.try_take(f"t{i}", "batch", None, float(i))
        p.release(f"t{i}", float(i))
    assert p.busy == 0 and p.tenants() <= 256  # a sweep every 256 releases: those active since, at most


def test_slot_caps_are_learned_from_the_engine_counters() -> None:
    e = SlotEstimate()
    e = learn_slots(e, running=3, waiting=0, now=0.0)
    assert e.cap is None  # never seen saturated: unknown
    e = learn_slots(e, running=4, waiting=2, now=1.0)
    assert e == SlotEstimate(4, 1.0)
    e = learn_slots(e, running=4, waiting=0, now=30.0)
    assert e.cap == 4  # at the cap with nothing waiting: maybe the gateway holds back, not probed yet
    e = learn_slots(e, running=4, waiting=0, now=61.0)
    assert e == SlotEstimate(5, 61.0)  # a minute unsaturated: one more
    e = learn_slots(e, running=3, waiting=1, now=62.0)
    assert e.cap == 3  # KV ran short: what it runs now
    assert foreign(running=5, waiting=2, own_in_flight=4) == 3 and foreign(1, 0, 4) == 0
    assert free_slots(4, 3) == 1 and free_slots(4, 9) == 0 and free_slots(None, 3) is None
    assert model_capacity([2, 3]) == 5 and model_capacity([2, None]) is None


def test_priority_header_values() -> None:
    assert parse_priority(None, "interactive", "h") == "interactive"
    assert parse_priority(" Batch ", "interactive", "h") == "batch"
    with pytest.raises(BadRequest):
        parse_priority("urgent", "interactive", "h")


def gate(cap: list[int | None], **kw: object) -> Admission:
    s = AdmissionSettings.model_validate({"enabled": True, "worker_slots": 1, "queue_size": 2,
                                          "max_queue_wait_s": 5.0, **kw})
    return Admission(s, MemoryQuotaStore(), lambda model: cap[0], 1)


async def test_gate_queues_in_fair_order_and_refuses_when_full() -> None:
    cap = [1]
    g = gate(cap, tenants={"b": {"weight": 1.0}})
    t0 = await g.admit("a", "m", "interactive", 1)
    order: list[str] = []

    async def wait(tenant: str, prio: str) -> None:
        t = await g.admit(tenant, "m", prio, 1)  # type: ignore[arg-type]
        order.append(f"{tenant}:{prio}")
        t.release()

    w1 = asyncio.create_task(wait("a", "batch"))
    w2 = asyncio.create_task(wait("b", "interactive"))
    await asyncio.sleep(0.01)
    assert g.queued("m") == 2
    with pytest.raises(ServiceUnavailable) as exc:
        await g.admit("c", "m", "interactive", 1)
    assert exc.value.code == "queue_full" and exc.value.headers["Retry-After"] == "1"
    t0.release()
    await asyncio.gather(w1, w2)
    assert order == ["b:interactive", "a:batch"]
    assert g.busy("m") == 0 and g.queued() == 0


async def test_gate_wait_times_out_and_a_cancelled_waiter_frees_its_place() -> None:
    cap = [1]
    g = gate(cap, max_queue_wait_s=0.05)
    t0 = await g.admit("a", "m", "interactive", 1)
    with pytest.raises(ServiceUnavailable) as exc:
        await g.admit("a", "m", "interactive", 1)
    assert exc.value.code == "queue_timeout"
    assert g.queued() == 0 and g.rejected == {"queue_timeout": 1}
    g.settings.max_queue_wait_s = 5.0
    waiter = asyncio.create_task(g.admit("b", "m", "interactive", 1))
    await asyncio.sleep(0.01)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert g.queued() == 0
    t0.release()
    assert g.busy("m") == 0
    t1 = await g.admit("b", "m", "interactive", 1)  # the slot is free again
    t1.release()


async def test_gate_refuses_over_the_tenant_limit_with_openai_shape() -> None:
    g = gate([None], defaults={"max_concurrent": 1, "requests_per_minute": 100})
    t = await g.admit("a", "m", "interactive", 1)
    with pytest.raises(RateLimited) as exc:
        await g.admit("a", "m", "interactive", 1)
    body = exc.value.body()["error"]
    assert exc.value.status == 429 and body["code"] == "rate_limit_exceeded"
    assert body["type"] == "concurrent_requests" and "Limit 1" in body["message"]
    assert exc.value.headers["Retry-After"] == "1"
    t.release()
    t.release()  # idempotent
    await asyncio.sleep(0)  # the lease is given back off the request's path
    (await g.admit("a", "m", "interactive", 1)).release()
    await g.aclose()


def test_tenant_overrides_replace_only_the_fields_given() -> None:
    s = AdmissionSettings(defaults=TenantLimits(max_concurrent=4, requests_per_minute=60),
                          tenants={"big": TenantLimits(max_concurrent=16, weight=4)})
    big = s.limits_for("big")
    assert (big.max_concurrent, big.requests_per_minute, big.weight) == (16, 60, 4)
    assert s.limits_for("other") == s.defaults


@pytest.fixture
async def redis_store() -> AsyncIterator[RedisQuotaStore]:
    prefix = f"kvgate-test-adm:{uuid.uuid4().hex[:8]}:"
    store = RedisQuotaStore(REDIS, prefix)
    yield store
    await store.close()
    r = aioredis.from_url(REDIS)
    keys = [k async for k in r.scan_iter(match=f"{prefix}*")]
    if keys:
        await r.delete(*keys)
    await r.aclose()


async def test_redis_script_decides_as_the_core_does(redis_store: RedisQuotaStore) -> None:
    mem = MemoryQuotaStore()
    q = Quota(max_concurrent=3, requests_per_minute=4, tokens_per_minute=1000)
    steps = [300, 300, 500, 300, 10, 10, 10]  # tokens, then requests, then concurrency refuse
    got_mem, got_redis = [], []
    for i, tokens in enumerate(steps):
        for store, out in ((mem, got_mem), (redis_store, got_redis)):
            v = await store.admit("t", q, tokens, f"l{i}", 30)
            out.append((v.ok, v.limit))
    assert got_mem == got_redis
    assert [lim for _, lim in got_redis] == [None, None, "tokens_per_minute", None, "max_concurrent",
                                             "max_concurrent", "max_concurrent"]
    await redis_store.release("t", "l0")
    assert (await redis_store.admit("t", q, 10, "x", 30)).ok  # the fourth request of the minute
    await redis_store.release("t", "x")
    assert await redis_store.leases("t") == 2
    v = await redis_store.admit("t", q, 10, "y", 30)
    assert v.limit == "requests_per_minute" and 0 < (v.retry_after_s or 0) <= 15
    v = await redis_store.admit("t", Quota(tokens_per_minute=5), 6, "y", 30)
    assert v.limit == "tokens_per_minute" and v.retry_after_s == math.inf


async def test_redis_charges_and_levels_as_the_core_does(redis_store: RedisQuotaStore) -> None:
    mem = MemoryQuotaStore()
    for store in (mem, redis_store):
        assert await store.level("t", "prefill", 600) == pytest.approx(600.0)  # a new bucket is full
        await store.charge("t", "prefill", 600, 450)
        await store.charge("t", "tokens", 600, 100)
        assert await store.level("t", "prefill", 600) == pytest.approx(150.0, abs=1.0)
        assert await store.level("t", "tokens", 600) == pytest.approx(500.0, abs=1.0)
        await store.charge("t", "prefill", 600, 10_000)
        assert await store.level("t", "prefill", 600) == pytest.approx(-600.0, abs=1.0)
    v = await redis_store.admit("u", Quota(requests_per_minute=10, tokens_per_minute=1000), 100, "l", 30)
    assert v.ok and v.requests is not None and v.tokens is not None
    assert (v.requests.remaining, v.tokens.remaining) == (9.0, 900.0)


def test_the_memory_store_forgets_idle_tenants() -> None:
    now = [0.0]
    store = MemoryQuotaStore(lambda: now[0], sweep_every=4)
    q = Quota(max_concurrent=1, requests_per_minute=10)

    async def run() -> None:
        for i in range(3):
            await store.admit(f"idle{i}", q, 1, "x", 30)
            await store.release(f"idle{i}", "x")
        await store.admit("busy", q, 1, "held", 1000)  # its lease is live
        now[0] = 500.0
        for i in range(4):
            await store.admit(f"new{i}", q, 1, "y", 30)

    asyncio.run(run())
    assert store.tenants() == 5  # the busy one and the four new ones


async def test_redis_leases_expire_unless_renewed(redis_store: RedisQuotaStore) -> None:
    q = Quota(max_concurrent=2)
    assert (await redis_store.admit("t", q, 1, "kept", 1.0)).ok
    assert (await redis_store.admit("t", q, 1, "dead", 1.0)).ok
    assert not (await redis_store.admit("t", q, 1, "x", 1.0)).ok
    for _ in range(3):  # the live replica renews; the dead one's lease runs out
        await asyncio.sleep(0.5)
        await redis_store.renew({"t": {"kept"}}, 1.0)
    assert await redis_store.leases("t") == 1
    assert (await redis_store.admit("t", q, 1, "new", 30)).ok


async def test_a_quota_store_that_is_down_admits_unmetered() -> None:
    from tests.conftest import free_port

    s = AdmissionSettings(enabled=True, defaults=TenantLimits(max_concurrent=1, requests_per_minute=1))
    g = Admission(s, RedisQuotaStore(f"redis://127.0.0.1:{free_port()}/0"), lambda model: None, 1)
    tickets = [await g.admit("a", "m", "interactive", 1) for _ in range(3)]  # over both limits, yet served
    assert all(t.lease is None for t in tickets) and g.rejected == {}
    for t in tickets:
        t.release()
    await g.aclose()
