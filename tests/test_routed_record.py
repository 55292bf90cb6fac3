"""The fleet's routed-prefix record (kvstore/routed.py, gateway/routedsync.py): three replicas on one
Redis in front of workers without KV events, each knowing the others' routes — and one that joins."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import httpx
import redis.asyncio as aioredis

from kvgate.assembly import create_app
from kvgate.demo import SYSTEM
from kvgate.gateway.prefix import PrefixKnowledge
from kvgate.gateway.routedsync import RoutedSync, spec_tag
from kvgate.kvstore.routed import RedisRoutedRecord, encode, parse
from kvgate.router.hashing import HashSpec
from kvgate.router.types import WorkerId
from kvgate.serving import start_server
from tests.conftest import MODEL, Cluster

REDIS = "redis://127.0.0.1:6379/0"
LONG_SYSTEM = " ".join([SYSTEM] * 4)  # several blocks every conversation of the fleet shares


def gateways(c: Cluster) -> list[Any]:
    return [r.server.config.app.state.gateway for r in c.replicas]


async def first_turn(h: httpx.AsyncClient, url: str, conv: str, task: str = "fix the bug") -> tuple[int, str]:
    """A new conversation's first request: (cached tokens, the worker that served it)."""
    body = {"model": MODEL, "max_tokens": 4, "messages": [
        {"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": f"task {conv}: {task}"}]}
    r = await h.post(url + "/v1/chat/completions", json=body, headers={"x-conversation-id": conv})
    assert r.status_code == 200, r.text
    return (r.json()["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0), r.headers["x-kvgate-worker"]


async def fleet_run(make_cluster: Any, poll_s: float) -> tuple[list[tuple[int, str]], list[tuple[int, str]], Cluster,
                                                                   str]:
    """Nine conversations sharing the system prompt, round robin over three replicas, one at a time
    (each after the previous one's routes had a poll to spread); then three from a replica that joins.
    The first lands where the worker every cold replica would pick (the ties' winner) is busy at that
    moment, as in a fleet under load: a replica that did not see that route cannot guess it."""
    prefix = f"kvt-routed-{uuid.uuid4().hex[:8]}:"
    c = await make_cluster(3, replicas=3, session_store="redis", redis_url=REDIS, redis_prefix=prefix,
                           routed_record_poll_s=poll_s, sim={"speed": 2.0})
    rows = []
    async with httpx.AsyncClient(timeout=60) as h:
        hog_body = {"model": MODEL, "max_tokens": 400, "ignore_eos": True,
                    "messages": [{"role": "user", "content": "write a long story"}]}
        hog = asyncio.create_task(h.post(c.urls[0] + "/v1/chat/completions", json=hog_body,
                                         headers={"x-conversation-id": "hog"}))
        g0 = gateways(c)[0]
        for _ in range(500):  # until the hog is in flight
            if any(w.in_flight for w in g0.pool.all()):
                break
            await asyncio.sleep(0.01)
        busy = next(w.id for w in g0.pool.all() if w.in_flight)
        rows.append(await first_turn(h, c.urls[0], "c0"))
        assert rows[0][1] != busy  # the precondition: the prompt is not where the ties would put it
        assert (await hog).status_code == 200
        for i in range(1, 9):
            await asyncio.sleep(0.4)
            rows.append(await first_turn(h, c.urls[i % 3], f"c{i}"))
        await asyncio.sleep(0.4)
        late = await start_server(create_app(g0.settings))
        try:
            joiner = [await first_turn(h, late.url, f"late{i}") for i in range(3)]
        finally:
            await late.stop()
    return rows, joiner, c, prefix


def hit_share(rows: list[tuple[int, str]], floor: int) -> float:
    return sum(1 for cached, _ in rows if cached >= floor) / len(rows)


async def test_three_replicas_route_to_the_worker_holding_the_shared_prompt(make_cluster: Any) -> None:
    rows, joiner, c, prefix = await fleet_run(make_cluster, 0.1)
    floor = 128  # most of the shared system prompt (~1,400 tokens), in whole blocks
    # The first conversation is cold; every later one, on whichever replica, reuses the prompt.
    assert rows[0][0] == 0 and hit_share(rows[1:], floor) == 1.0, rows
    assert len({w for _, w in rows}) == 1  # and the fleet holds it once
    assert hit_share(joiner, floor) == 1.0, joiner  # the joiner's very first request included
    gws = gateways(c)
    assert all(g.routed_sync.merged > 0 for g in gws[1:])
    # What is stored: 8-byte members, a record per worker and hash identity, expiring with the TTL.
    r = aioredis.from_url(REDIS)
    try:
        keys = [k async for k in r.scan_iter(match=f"{prefix}routed:*")]
        assert len(keys) == 1, keys
        entries = await r.zrange(keys[0], 0, -1, withscores=True)
        assert entries and all(len(m) == 8 for m, _ in entries)
        ttl_ms = await r.pttl(keys[0])
        assert 0 < ttl_ms <= gws[0].settings.approx_ttl_s * 1000
    finally:
        await r.aclose()
    # What the record buys, measured: the same run with it off. Each replica that did not route the
    # first conversation sends its own first one where the ties put it, and finds nothing there.
    alone, alone_joiner, _, _ = await fleet_run(make_cluster, 0.0)
    print(f"\nrouted to a worker holding the shared prompt: with the record {hit_share(rows, floor):.2f}, "
          f"without {hit_share(alone, floor):.2f}; a joiner's first three: {hit_share(joiner, floor):.2f} "
          f"vs {hit_share(alone_joiner, floor):.2f}; cached tokens {sum(x for x, _ in rows)} "
          f"vs {sum(x for x, _ in alone)}")
    assert hit_share(rows, floor) > hit_share(alone, floor)
    assert sum(x for x, _ in rows) > sum(x for x, _ in alone)
    assert len({w for _, w in alone}) > 1  # the prompt prefilled on more than one worker


async def test_only_blocks_not_published_lately_are_written(make_cluster: Any) -> None:
    prefix = f"kvt-routed-{uuid.uuid4().hex[:8]}:"
    c = await make_cluster(1, replicas=1, session_store="redis", redis_url=REDIS, redis_prefix=prefix,
                           routed_record_poll_s=0.1)
    g = gateways(c)[0]
    sync = g.routed_sync
    long_task = " ".join(f"step {i} of the plan" for i in range(120))
    async with httpx.AsyncClient(timeout=60) as h:
        _, wid = await first_turn(h, c.url, "a")
        await asyncio.sleep(0.3)
        shared = sync.published
        # The same system prompt, a long task of its own: only the task's blocks are new.
        await first_turn(h, c.url, "a2", long_task)
        await asyncio.sleep(0.3)
        new = sync.published - shared
        await first_turn(h, c.url, "a2", long_task)  # the same request again: all published a moment ago
        await asyncio.sleep(0.3)
    assert shared > 5 and 0 < new < 10, (shared, new)
    assert sync.published == shared + new
    r = aioredis.from_url(REDIS)
    try:
        spec = g.pool.spec(wid)
        assert await r.zcard(sync.record.key(f"{wid}:{spec_tag(spec)}")) == shared + new
    finally:
        await r.aclose()


def spec_and_prefix() -> tuple[HashSpec, PrefixKnowledge]:
    spec = HashSpec(16, "sha256", "0")
    return spec, PrefixKnowledge(lambda w: spec, lambda m: [spec], approx_ttl_s=120.0)


async def test_a_corrupt_entry_is_removed_and_the_rest_merged() -> None:
    prefix = f"kvt-routed-{uuid.uuid4().hex[:8]}:"
    spec, know = spec_and_prefix()
    wid = WorkerId("w1")
    now = [1000.0]
    wall = 1_700_000_000.0
    record = RedisRoutedRecord(REDIS, prefix, 120.0)
    sync = RoutedSync(record, know, lambda: [wid], lambda w: 100, lambda: now[0], lambda: wall, 0.1)
    key = record.key(f"{wid}:{spec_tag(spec)}")
    r = aioredis.from_url(REDIS)
    try:
        await r.zadd(key, {encode(11): wall - 5, encode(12): wall - 5, b"not-a-hash": wall - 5,
                           encode(13): wall + 3600.0})  # from the far future: no replica wrote that
        await sync.pull()
        assert record.corrupt == 2
        assert sorted(await r.zrange(key, 0, -1)) == [encode(11), encode(12)]  # healed
        assert know.approx.index.holds(wid, 11) and know.approx.index.holds(wid, 12)
        assert not know.approx.index.holds(wid, 13)
        # Merged with its own time: it expires when it would have on the replica that routed it.
        know.approx.expire(now[0] + 116.0)
        assert not know.approx.index.holds(wid, 11)
    finally:
        await r.delete(key)
        await r.aclose()
        await record.close()


async def test_a_store_down_leaves_each_replica_its_own_routes() -> None:
    spec, know = spec_and_prefix()
    wid = WorkerId("w1")
    record = RedisRoutedRecord("redis://127.0.0.1:1/0", "kvt-down:", 120.0, timeout_s=0.2)
    sync = RoutedSync(record, know, lambda: [wid], lambda w: 100, lambda: 1.0, lambda: 1.7e9, 0.05)
    await sync.start()  # the warm start fails quietly
    try:
        sync.note(wid, spec, [1, 2, 3])
        know.approx.record(wid, [1, 2, 3], 1.0)
        await asyncio.sleep(0.3)
        assert sync.failures >= 1 and sync.status()["pending"] == 0  # not kept to grow
        assert know.approx.index.match([1, 2, 3], workers=(wid,)) == {wid: 3}
    finally:
        await sync.stop()


def test_entries_not_written_by_kvgate_are_refused() -> None:
    now = 1_700_000_000.0
    assert parse(encode(2**64 - 1), now - 1, now, 120.0) == (2**64 - 1, now - 1)
    for member, score in ((b"short", now), (encode(1) + b"x", now), ("str", now), (encode(1), float("nan")),
                          (encode(1), -1.0), (encode(1), now + 3600)):
        assert parse(member, score, now, 120.0) is None
