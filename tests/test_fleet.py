"""The fleet store (timers with leases, observations, reservations and their tenants' totals): in memory
and in Redis, same behaviour; in Redis, three replicas claim each firing once, a dead claimer's timer
comes back, and replicas reserving for one tenant at once stay within its budget together."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from kvgate.kvstore.fleet import FleetStore, MemoryFleet
from kvgate.kvstore.redis_fleet import RedisFleet
from kvgate.router.types import ConversationId, WorkerId
from kvgate.session.state import ContinuationObserved, WaitObserved

URL = "redis://127.0.0.1:6379/0"
C, W, W1 = ConversationId("t/c"), WorkerId("w0"), WorkerId("w1")


@pytest.fixture(params=["memory", "redis"])
async def fleet(request: pytest.FixtureRequest) -> AsyncIterator[FleetStore]:
    if request.param == "memory":
        yield MemoryFleet()
        return
    prefix = f"kvgate-test:{uuid.uuid4().hex[:8]}:"
    f = RedisFleet(URL, prefix)
    yield f
    await f.close()
    r = aioredis.from_url(URL)
    keys = [k async for k in r.scan_iter(match=prefix + "*")]
    if keys:
        await r.delete(*keys)
    await r.aclose()


async def test_timers_fire_when_due_replace_and_cancel(fleet: FleetStore) -> None:
    await fleet.arm(C, "lapse", 10.0, 1)
    await fleet.arm(C, "settle", 20.0, 2)
    assert await fleet.claim(9.0, 5) == []
    await fleet.arm(C, "lapse", 12.0, 3)  # re-armed: the old token is gone
    [t] = await fleet.claim(12.5, 5)
    assert (t.kind, t.token) == ("lapse", 3)
    assert await fleet.claim(13.0, 5) == []  # claimed: leased until 17.5
    await fleet.done(t)
    await fleet.cancel(C, ("settle",))
    assert await fleet.claim(100.0, 5) == []


async def test_a_lease_that_ends_hands_the_timer_over(fleet: FleetStore) -> None:
    await fleet.arm(C, "prefetch", 1.0, 7)
    [first] = await fleet.claim(1.0, 5)
    # The claimer died: nobody calls done. After the lease the timer is due again, for someone else.
    [again] = await fleet.claim(6.5, 5)
    assert again == first
    await fleet.renew(again, 20.0)  # the new claimer keeps it while it works
    assert await fleet.claim(15.0, 5) == []
    await fleet.arm(C, "prefetch", 50.0, 8)
    await fleet.done(again)  # a stale done does not drop the re-armed timer
    [later] = await fleet.claim(50.0, 5)
    assert later.token == 8


async def test_observations_are_read_in_order(fleet: FleetStore) -> None:
    obs = [WaitObserved("t", ("grep",), 0.4, 1.0), ContinuationObserved("t", 3000, True)]
    for o in obs:
        await fleet.publish(o)
    assert await fleet.observations() == obs
    assert await fleet.observations() == []


async def test_reservations_expire_by_their_deadline(fleet: FleetStore) -> None:
    assert await fleet.reserve(W, C, 900, until=10.0, tenant="t", now=0.0)
    assert await fleet.reserve(W, ConversationId("t/d"), 100, until=20.0, tenant="t", now=0.0)
    assert (await fleet.reserved(5.0))[W] == 1000
    assert (await fleet.reserved(15.0))[W] == 100
    await fleet.unreserve(W, ConversationId("t/d"), tenant="t")
    assert (await fleet.reserved(15.0)).get(W, 0) == 0


async def test_a_tenants_reserved_total_counts_its_live_reservations_on_every_worker(fleet: FleetStore) -> None:
    await fleet.reserve(W, C, 900, until=10.0, tenant="t", now=0.0)
    await fleet.reserve(W1, ConversationId("t/d"), 100, until=20.0, tenant="t", now=0.0)
    await fleet.reserve(W, ConversationId("u/e"), 5000, until=20.0, tenant="u", now=0.0)
    assert await fleet.reserved_by("t", 5.0) == 1000 and await fleet.reserved_by("u", 5.0) == 5000
    assert await fleet.reserved_by("t", 10.0) == 100  # the first one's deadline passed
    await fleet.reserve(W1, ConversationId("t/d"), 300, until=20.0, tenant="t", now=10.0)  # replaces, not adds
    assert await fleet.reserved_by("t", 10.0) == 300
    await fleet.unreserve(W1, ConversationId("t/d"), tenant="t")
    assert await fleet.reserved_by("t", 10.0) == 0 and await fleet.reserved_by("nobody", 0.0) == 0
    per_worker = await fleet.reserved(10.0)
    assert per_worker[W] == 5000 and per_worker.get(W1, 0) == 0


async def test_a_reserve_over_the_tenants_budget_is_refused_and_writes_nothing(fleet: FleetStore) -> None:
    assert await fleet.reserve(W, C, 600, until=10.0, tenant="t", now=0.0, budget=1000)
    assert not await fleet.reserve(W1, ConversationId("t/d"), 500, until=10.0, tenant="t", now=1.0, budget=1000)
    assert (await fleet.reserved(1.0)).get(W1, 0) == 0 and await fleet.reserved_by("t", 1.0) == 600
    # The conversation's own reservation on that worker is replaced, so it does not count against itself.
    assert await fleet.reserve(W, C, 1000, until=12.0, tenant="t", now=2.0, budget=1000)
    assert await fleet.reserve(W, ConversationId("u/e"), 800, until=10.0, tenant="u", now=2.0, budget=1000)
    assert not await fleet.reserve(W1, ConversationId("t/d"), 1, until=20.0, tenant="t", now=2.0, budget=1000)
    # Once the first one's deadline passed, its room is back.
    assert await fleet.reserve(W1, ConversationId("t/d"), 500, until=20.0, tenant="t", now=12.0, budget=1000)
    assert await fleet.reserved_by("t", 12.0) == 500


async def test_replicas_reserving_for_one_tenant_at_once_stay_within_its_budget() -> None:
    prefix = f"kvgate-test:{uuid.uuid4().hex[:8]}:"
    replicas = [RedisFleet(URL, prefix) for _ in range(8)]
    try:
        for rnd in range(5):
            now = rnd * 200.0  # each round after the last one's deadlines
            got = await asyncio.gather(*(r.reserve(W, ConversationId(f"t/c{rnd}-{i}"), 400, until=now + 100,
                                                   tenant="t", now=now, budget=1000)
                                         for i, r in enumerate(replicas)))
            assert sum(got) == 2, got  # 2 x 400 fit in 1000, a third does not: exactly two pass
            assert await replicas[0].reserved_by("t", now) == 800
        # The tenant's hash expires by itself, a minute after its last deadline (100 s from the last round).
        rr = aioredis.from_url(URL)
        ttl = await rr.ttl(f"{prefix}{{fleet}}:parked:t")
        await rr.aclose()
        assert 100 < ttl <= 160
    finally:
        for r in replicas:
            await r.close()
        rr = aioredis.from_url(URL)
        keys = [k async for k in rr.scan_iter(match=prefix + "*")]
        if keys:
            await rr.delete(*keys)
        await rr.aclose()


async def test_three_replicas_claim_each_timer_once() -> None:
    prefix = f"kvgate-test:{uuid.uuid4().hex[:8]}:"
    replicas = [RedisFleet(URL, prefix) for _ in range(3)]
    try:
        for i in range(30):
            await replicas[0].arm(ConversationId(f"c{i}"), "prefetch", 1.0, i)
        claims = await asyncio.gather(*(r.claim(2.0, 30, limit=7) for r in replicas for _ in range(3)))
        got = [t for c in claims for t in c]
        assert len(got) == 30 and len({t.conversation for t in got}) == 30
        new = RedisFleet(URL, prefix)  # a replica that starts reads the observations still kept
        await replicas[1].publish(WaitObserved("t", ("x",), 1.0, 2.0))
        assert len(await new.observations()) == 1
        await new.close()
    finally:
        for r in replicas:
            await r.close()
        rr = aioredis.from_url(URL)
        keys = [k async for k in rr.scan_iter(match=prefix + "*")]
        if keys:
            await rr.delete(*keys)
        await rr.aclose()
