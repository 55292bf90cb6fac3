"""The engines' learned slot caps shared by the replicas (kvstore/capacity.py, admission/slotsync.py):
three replicas on one Redis learn a worker's cap, and a replica that joins admits with it from its first
request instead of over-admitting; what kvgate did not write is dropped and counted."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import httpx
import redis.asyncio as aioredis

from kvgate.admission.capacity import SlotEstimate, learn_slots, merge_slots
from kvgate.admission.slotsync import SlotSync
from kvgate.assembly import create_app
from kvgate.config import GatewaySettings, WorkerConfig
from kvgate.kvstore.capacity import RedisSlotBoard, parse
from kvgate.kvstore.corrupt import Corruption
from kvgate.serving import start_server
from tests.conftest import MODEL, Cluster
from tests.helpers import eventually

REDIS = "redis://127.0.0.1:6379/0"
SLOW = {"speed": 1.0, "profile": "cpu-tiny", "max_num_seqs": 2}
"""An engine that runs two requests at once; the tiny model's 2000 reasoning tokens hold a slot for
seconds (each stream is ended by the test)."""
LONG = {"model": MODEL, "messages": [{"role": "user", "content": "think"}], "stream": True,
        "sim": {"reasoning_tokens": 2000, "answer_tokens": 4}}


def gateways(c: Cluster) -> list[Any]:
    return [r.server.config.app.state.gateway for r in c.replicas]


@asynccontextmanager
async def streams(h: httpx.AsyncClient, url: str, n: int) -> AsyncIterator[list[asyncio.Task[None]]]:
    """``n`` long streams sent at once, each held open once it started; all ended on leaving."""
    stop = asyncio.Event()

    async def one(i: int) -> None:
        async with h.stream("POST", url + "/v1/chat/completions", json=LONG,
                            headers={"x-tenant-id": "t", "x-conversation-id": f"s{uuid.uuid4().hex[:6]}{i}"}) as r:
            assert r.status_code == 200, await r.aread()
            lines = r.aiter_lines()
            async for line in lines:
                if '"reasoning"' in line:
                    break
            await stop.wait()
            await lines.aclose()

    tasks = [asyncio.create_task(one(i)) for i in range(n)]
    try:
        yield tasks
    finally:
        stop.set()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def joiner(c: Cluster, prefix: str, share_ttl_s: float) -> GatewaySettings:
    w, handle = c.sims[0]
    # Its own health rounds are far apart: whatever cap it has in the test, it did not learn it itself.
    return GatewaySettings(workers=[WorkerConfig(url=handle.url, model=MODEL, engine="sim",
                                                 block_size=w.profile.block_size)],
                           session_store="redis", redis_url=REDIS, redis_prefix=prefix, hash_seed="0",
                           health_interval_s=30, admission={"enabled": True, "slot_share_ttl_s": share_ttl_s})


async def test_a_replica_that_joins_admits_with_the_cap_the_others_learned(make_cluster: Any) -> None:
    prefix = f"kvt-slots-{uuid.uuid4().hex[:8]}:"
    c = await make_cluster(1, sim=SLOW, replicas=3, session_store="redis", redis_url=REDIS, redis_prefix=prefix,
                           health_interval_s=0.2, admission={"enabled": True})
    wid = f"127.0.0.1:{c.sims[0][1].port}"
    gws = gateways(c)
    assert all(g.pool.get(wid).cap is None for g in gws)
    async with httpx.AsyncClient(timeout=60) as h:
        # Three at once on an engine that runs two: it queues one, and the health rounds learn its cap.
        async with streams(h, c.urls[0], 3):
            await eventually(lambda: all(g.pool.get(wid).cap == 2 for g in gws), timeout_s=20)
            r = aioredis.from_url(REDIS)

            async def shared() -> bool:
                return bool(await r.hexists(f"{prefix}slots", wid))

            await eventually(shared, timeout_s=5)
            await r.aclose()
        await eventually(lambda: all(g.pool.get(wid).running == 0 for g in gws), timeout_s=10)
        # The engine idle now: no poll learns anything new.
        r = aioredis.from_url(REDIS)
        # A garbled entry: dropped and counted by the replicas that read it, and written again by one
        # that knows the cap (the fleet does not wait for the engine's next saturation).
        await r.hset(f"{prefix}slots", wid, b"99999999|nan|someone")

        async def healed() -> bool:
            v = await r.hget(f"{prefix}slots", wid)
            return v is not None and v.startswith(b"2|")

        await eventually(healed, timeout_s=5)
        text = "".join([(await h.get(u + "/metrics")).text for u in c.urls])
        found = [line for line in text.splitlines()
                 if line.startswith('kvgate_store_corrupt_records_total{kind="slot_estimate"}')]
        assert len(found) == 3 and sum(float(x.split()[-1]) for x in found) >= 1, found
        await r.aclose()

        async with AsyncExitStack() as stack:
            late = await start_server(create_app(joiner(c, prefix, 3600)))
            stack.push_async_callback(late.stop)
            alone = await start_server(create_app(joiner(c, prefix, 0)))  # the same, not sharing
            stack.push_async_callback(alone.stop)
            lg, ag = (x.server.config.app.state.gateway for x in (late, alone))
            assert lg.pool.get(wid).cap == 2 and lg.slot_sync.adopted == 1
            assert "kvgate_slot_estimates_adopted_total 1.0" in (await h.get(late.url + "/metrics")).text
            assert ag.pool.get(wid).cap is None and ag.slot_sync is None

            # Its first three requests: two run, the third waits in its queue, the engine's queue stays empty.
            async with streams(h, late.url, 3):
                await eventually(lambda: lg.pool.get(wid).in_flight == 2 and lg.admission.queued(MODEL) == 1,
                                 timeout_s=20)
                await asyncio.sleep(0.5)
                assert lg.pool.get(wid).in_flight == 2 and lg.admission.queued(MODEL) == 1
            await eventually(lambda: all(g.pool.get(wid).running == 0 for g in gws), timeout_s=10)
            # Without the fleet's cap the same three all go to the engine, which can run only two of them.
            async with streams(h, alone.url, 3):
                await eventually(lambda: ag.pool.get(wid).in_flight == 3, timeout_s=20)
                assert ag.admission.queued(MODEL) == 0


async def board(prefix: str, ttl_s: float = 3600) -> RedisSlotBoard:
    return RedisSlotBoard(REDIS, prefix, ttl_s, Corruption())


async def test_garbled_entries_are_dropped_removed_and_counted() -> None:
    prefix = f"kvt-slots-{uuid.uuid4().hex[:8]}:"
    b = await board(prefix)
    r = aioredis.from_url(REDIS)
    now = time.time()
    try:
        await b.publish({"w0": (4, now - 1)}, "rA")
        bad = {"w1": b"garbage", "w2": f"0|{now}|rB".encode(), "w3": f"99999999|{now}|rB".encode(),
               "w4": f"4|{now + 3600}|rB".encode(), "w5": b"4|nan|rB", "w6": b"\xff\xfe|1|x", "w7": b"4|1e9|"}
        await r.hset(f"{prefix}slots", mapping=bad)  # type: ignore[arg-type]
        got = await b.read(["w0", *bad, "absent"], now)
        assert got == {"w0": (4, round(now - 1, 6), "rA")}
        assert b.corruption.counts["slot_estimate"] == len(bad)
        assert await r.hkeys(f"{prefix}slots") == [b"w0"]  # removed: the next reader does not meet them
        await b.read(["w0", *bad], now)
        assert b.corruption.counts["slot_estimate"] == len(bad)
        # A key of another type: nothing read, counted, deleted, so the next write lands.
        await r.delete(f"{prefix}slots")
        await r.set(f"{prefix}slots", b"x")
        w0 = W("w0", SlotEstimate(3, time.monotonic()))
        sync = SlotSync(b, lambda: [w0], time.monotonic, time.time, "rA", 1.0)
        await sync.start()
        assert b.corruption.counts["slot_estimate"] == len(bad) + 1
        await sync.stop()  # writes what it learned
        assert (await b.read(["w0"], time.time()))["w0"][0] == 3
    finally:
        await r.delete(f"{prefix}slots")
        await r.aclose()


async def test_an_older_reading_never_replaces_a_newer_one() -> None:
    prefix = f"kvt-slots-{uuid.uuid4().hex[:8]}:"
    a, b = await board(prefix), await board(prefix)
    now = time.time()
    try:
        await a.publish({"w": (8, now - 1)}, "rA")
        await b.publish({"w": (16, now - 100)}, "rB")  # learned earlier, written later
        assert (await a.read(["w"], now))["w"][:2] == (8, round(now - 1, 6))
        await b.publish({"w": (6, now)}, "rB")
        assert (await a.read(["w"], now))["w"][:2] == (6, round(now, 6))
        # Past the TTL a reading is not used.
        old = await board(prefix, ttl_s=0.5)
        assert await old.read(["w"], now + 1) == {}
    finally:
        await a._r.delete(a.key)
        for x in (a, b):
            await x.close()


class W:
    def __init__(self, wid: str, slots: SlotEstimate) -> None:
        self.id, self.slots = wid, slots


async def test_the_newest_reading_wins_and_probing_is_paced_fleet_wide() -> None:
    prefix = f"kvt-slots-{uuid.uuid4().hex[:8]}:"
    mono = time.monotonic()
    a = W("w", learn_slots(SlotEstimate(), 8, 2, mono - 50))  # saw it saturated at 8, 50 s ago
    b = W("w", SlotEstimate())
    sa = SlotSync(await board(prefix), lambda: [a], time.monotonic, time.time, "rA", 1.0)
    sb = SlotSync(await board(prefix), lambda: [b], time.monotonic, time.time, "rB", 1.0)
    try:
        await sa.push()
        await sb.pull()
        assert b.slots.cap == 8 and abs(b.slots.saturated_at - a.slots.saturated_at) < 0.01
        await sb.push()  # what it adopted is not written back as its own
        assert sb.published == 0
        # B probes one more only when the fleet has not seen the engine saturated for probe_after_s.
        assert learn_slots(b.slots, 8, 0, mono, probe_after_s=60) == b.slots
        # A newer reading of A's (the engine has less room now) replaces B's; an older one would not.
        a.slots = learn_slots(a.slots, 5, 1, mono)
        await sa.push()
        await sb.pull()
        assert b.slots.cap == 5 and sb.adopted == 2
        assert merge_slots(b.slots, SlotEstimate(9, b.slots.saturated_at - 1)) is b.slots
    finally:
        await sa.board._r.delete(f"{prefix}slots")  # type: ignore[attr-defined]
        await sa.stop()
        await sb.stop()


def test_values_kvgate_did_not_write_are_refused() -> None:
    now = 1.7e9
    assert parse(b"4|1699999999.5|abc", now) == (4, 1699999999.5, "abc")
    for bad in (b"", b"4", b"4|1", b"x|1|a", b"4|x|a", b"-1|1|a", b"4|inf|a", b"4|0|a", b"4|1|", b"4|1|a|b",
                b"4|" + str(now + 61).encode() + b"|a", b"1" * 200, "4|1|a"):
        assert isinstance(parse(bad, now), str), bad
