"""Garbage in every key kind kvgate owns in Redis heals within one turn (a conversation's keys) or one
tick of the session runtime (the fleet's keys), with two gateway replicas sharing the Redis.

The cases are a fixed list (deterministic): for each key kind, bytes that are not msgpack, truncated
and huge values, well-formed maps of either codec version (schema 1, and 2 as a newer replica would
write) with fields of the wrong type, and keys holding the wrong Redis type. Healed means: requests
are answered (200, or the 404 a missing record answers), the admin views answer 200 on both replicas,
the next turn is recorded again (the record says it was reset), the malformed fleet entry is gone
from Redis and the runtime loop still applies what other replicas write.

On a0afb21 the conversation cases kept answering 503 on the admin view and never recorded a turn, and
a malformed reservation made ``/admin/tiers`` answer 500 and stopped both runtimes.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import msgpack
import pytest
import redis.asyncio as aioredis

from kvgate.assembly import Gateway
from kvgate.kvstore.redis_fleet import RedisFleet
from kvgate.router.types import ConversationId, WorkerId
from kvgate.session.state import WaitObserved
from tests.conftest import MODEL, Cluster

URL = "redis://127.0.0.1:6379/0"
HUGE = bytes(range(256)) * (8 * 1024)  # 2 MiB

Writer = Callable[[aioredis.Redis, str, str], Awaitable[Any]]
"""(redis, key prefix, conversation id) -> writes the garbage."""


def _head(schema: int, **fields: Any) -> dict[str, Any]:
    """A well-formed head of codec ``schema`` but for ``fields`` (its id: the conversation's own)."""
    return {"schema": schema, "version": 1, **fields}


def head_data(value: bytes | dict[str, Any]) -> Writer:
    async def w(r: aioredis.Redis, prefix: str, cid: str) -> None:
        data = value if isinstance(value, bytes) else msgpack.packb({"id": cid, **value}, use_bin_type=True)
        await r.hset(f"{prefix}{{{cid}}}:h", "data", data)
    return w


def head_field(field: str, value: Any) -> Writer:
    async def w(r: aioredis.Redis, prefix: str, cid: str) -> None:
        await r.hset(f"{prefix}{{{cid}}}:h", field, value)
    return w


def body(value: bytes) -> Writer:
    async def w(r: aioredis.Redis, prefix: str, cid: str) -> None:
        key = f"{prefix}{{{cid}}}:b"
        await r.set(key, value, keepttl=True)
        # The head's body generation moves on, so the replicas that hold the old body read this one.
        head = msgpack.unpackb(await r.hget(f"{prefix}{{{cid}}}:h", "data"), raw=False)
        head["body_gen"] += 1
        await r.hset(f"{prefix}{{{cid}}}:h", "data", msgpack.packb(head, use_bin_type=True))
    return w


def wrong_type(suffix: str, kind: str) -> Writer:
    async def w(r: aioredis.Redis, prefix: str, cid: str) -> None:
        key = f"{prefix}{{{cid}}}:{suffix}"
        await r.delete(key)
        await {"string": lambda: r.set(key, b"x"), "list": lambda: r.rpush(key, b"x"),
               "set": lambda: r.sadd(key, b"x"), "zset": lambda: r.zadd(key, {b"x": 1.0}),
               "hash": lambda: r.hset(key, "x", "1")}[kind]()
    return w


def truncated_head() -> Writer:
    async def w(r: aioredis.Redis, prefix: str, cid: str) -> None:
        key = f"{prefix}{{{cid}}}:h"
        data = await r.hget(key, "data")
        await r.hset(key, "data", data[: len(data) // 2])
    return w


def body_of(**fields: Any) -> bytes:
    return msgpack.packb({"model": MODEL, "history": [], "body_gen": 99, **fields}, use_bin_type=True)


CONVERSATION_CASES: list[tuple[str, Writer]] = [
    ("head not msgpack", head_data(b"\xc1garbage")),
    ("head truncated", truncated_head()),
    ("head huge", head_data(HUGE)),
    ("head a list", head_data(msgpack.packb([1, 2, 3]))),
    ("head id of another conversation", head_data(msgpack.packb({"id": "someone-else", "schema": 1}))),
    ("head v1 turn count a float", head_data(_head(1, turns=[], turn_count=-0.5))),
    ("head v1 turns a string", head_data(_head(1, turns="many"))),
    ("head v1 turn tokens a string", head_data(_head(1, turns=[{"worker": "w", "reason": "r", "prompt_tokens": "x",
                                                                "cached_tokens": 0, "completion_tokens": 0,
                                                                "ttft_s": None}]))),
    ("head v1 unknown lifecycle state", head_data(_head(1, session={"lifecycle": {"state": "dancing"}}))),
    ("head v1 version a float", head_data(_head(1, version=float("inf")))),
    ("head v2 home a number", head_data(_head(2, home=12, extra_field="kept"))),
    ("head v2 totals a list", head_data(_head(2, totals=[1, 2]))),
    ("head v2 reservation tokens a map", head_data(_head(2, session={"reservation": {
        "worker": "w", "tokens": {}, "until": 1.0, "token": 1}}))),
    ("ver not a number", head_field("ver", b"\xffnope")),
    ("ver negative", head_field("ver", b"-3")),
    ("head without data", lambda r, p, c: r.hdel(f"{p}{{{c}}}:h", "data")),
    ("head key a string", wrong_type("h", "string")),
    ("head key a list", wrong_type("h", "list")),
    ("head key a zset", wrong_type("h", "zset")),
    ("body not msgpack", body(b"\x92\x01")),
    ("body huge", body(HUGE)),
    ("body chain tokens not uint32", body(body_of(chain={"text": "x", "tokens": b"abc", "anchor_chars": b"",
                                                         "anchor_tokens": b""}))),
    ("body chain anchors past its text", body(body_of(chain={
        "text": "x", "tokens": b"", "anchor_chars": b"\xff\x00\x00\x00", "anchor_tokens": b"\x00\x00\x00\x00"}))),
    ("body history of numbers", body(body_of(history=[1, 2]))),
    ("body responses of maps", body(body_of(responses=[{}]))),
    ("body key a hash", wrong_type("b", "hash")),
    ("body key a set", wrong_type("b", "set")),
]


@pytest.fixture
async def two(make_cluster: Any) -> AsyncIterator[tuple[Cluster, str, aioredis.Redis]]:
    prefix = f"kvgate-test:{uuid.uuid4().hex[:8]}:"
    c = await make_cluster(2, replicas=2, session_store="redis", redis_url=URL, redis_prefix=prefix)
    r = aioredis.from_url(URL)
    yield c, prefix, r
    keys = [k async for k in r.scan_iter(match=prefix + "*")]
    if keys:
        await r.delete(*keys)
    await r.aclose()


def gateway(c: Cluster, i: int) -> Gateway:
    gw: Gateway = c.replicas[i].server.config.app.state.gateway
    return gw


async def turn(h: httpx.AsyncClient, url: str, cid: str, text: str) -> httpx.Response:
    return await h.post(url + "/v1/chat/completions", headers={"x-conversation-id": cid}, json={
        "model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": text}]})


async def record(h: httpx.AsyncClient, url: str, cid: str, turns: int) -> dict[str, Any]:
    """The admin record once it has ``turns`` turns (a turn is recorded as its response ends)."""
    deadline = time.monotonic() + 10
    while True:
        r = await h.get(f"{url}/admin/conversations/{cid}")
        assert r.status_code == 200, r.text
        rec: dict[str, Any] = r.json()
        if rec["turn_count"] >= turns or time.monotonic() > deadline:
            return rec
        await asyncio.sleep(0.02)


async def heal_conversation(c: Cluster, prefix: str, r: aioredis.Redis, name: str, write: Writer) -> bool:
    cid = f"fuzz-{uuid.uuid4().hex[:8]}"
    a, b = c.urls
    async with httpx.AsyncClient(timeout=30) as h:
        assert (await turn(h, a, cid, "first")).status_code == 200
        assert (await record(h, a, cid, 1))["turn_count"] == 1
        await write(r, prefix, cid)
        for url in (a, b):  # readable on both replicas before any turn: as a reset record, not a 503
            seen = await h.get(f"{url}/admin/conversations/{cid}")
            assert seen.status_code == 200, (name, seen.text)
            # Replica A holds the body it wrote and reads only the head, which is intact: it sees no garbage.
            assert seen.json()["reset"] or (url == a and name.startswith("body key")), (name, seen.json())
        got = await turn(h, b, cid, "after the garbage")
        assert got.status_code == 200, (name, got.text)
        healed = await record(h, b, cid, 1)
        assert healed["turn_count"] == 1 and healed["reset"], (name, healed)  # a fresh record, that says so
        assert (await turn(h, a, cid, "and on")).status_code == 200
        again = await record(h, a, cid, 2)
        assert again["turn_count"] == 2 and again["reset"] == healed["reset"], (name, again)
    return True


async def test_garbage_in_a_conversations_keys_heals_within_one_turn(
        two: tuple[Cluster, str, aioredis.Redis]) -> None:
    c, prefix, r = two
    sem = asyncio.Semaphore(6)

    async def one(name: str, write: Writer) -> bool:
        async with sem:
            return await heal_conversation(c, prefix, r, name, write)

    healed = await asyncio.gather(*(one(n, w) for n, w in CONVERSATION_CASES))
    report("conversation", len(CONVERSATION_CASES), sum(healed))
    found = sum(gateway(c, i).store.corruption.counts["conversation"] for i in (0, 1))
    assert found >= len(CONVERSATION_CASES)
    metrics = (await httpx.AsyncClient().get(c.urls[1] + "/metrics")).text
    assert 'kvgate_store_corrupt_records_total{kind="conversation"}' in metrics


RESPONSE_CASES: list[tuple[str, Callable[[aioredis.Redis, str], Awaitable[Any]]]] = [
    ("a hash", lambda r, k: r.hset(k, "x", "y")),
    ("a list", lambda r, k: r.rpush(k, "x")),
    ("not utf-8", lambda r, k: r.set(k, b"\xff\xfe")),
    ("huge", lambda r, k: r.set(k, HUGE)),
    ("an unknown conversation", lambda r, k: r.set(k, "nobody/knows")),
]


async def test_garbage_response_ids_answer_404_and_are_dropped(two: tuple[Cluster, str, aioredis.Redis]) -> None:
    c, prefix, r = two
    healed = 0
    async with httpx.AsyncClient(timeout=30) as h:
        for name, write in RESPONSE_CASES:
            rid = f"chatcmpl-fuzz{uuid.uuid4().hex[:8]}"
            key = f"{prefix}r:{rid}"
            await write(r, key)
            for url in c.urls:
                got = await h.post(url + "/v1/chat/completions", json={
                    "model": MODEL, "max_tokens": 8, "previous_response_id": rid,
                    "messages": [{"role": "user", "content": "go on"}]})
                assert got.status_code == 404, (name, got.text)
                assert got.json()["error"]["code"] == "response_not_found"
            if name not in ("huge", "an unknown conversation"):  # any string may be a conversation id
                assert not await r.exists(key), name
            healed += 1
    report("response_id", len(RESPONSE_CASES), healed)


def fleet_key(prefix: str, name: str) -> str:
    return f"{prefix}{{fleet}}:{name}"


async def set_type(r: aioredis.Redis, key: str, kind: str) -> None:
    await r.delete(key)
    await {"string": lambda: r.set(key, b"x"), "list": lambda: r.rpush(key, b"x"),
           "hash": lambda: r.hset(key, "x", "1"), "zset": lambda: r.zadd(key, {b"x": 1.0})}[kind]()


FLEET_CASES: list[tuple[str, str, Callable[[aioredis.Redis, str], Awaitable[Any]], Callable[[aioredis.Redis, str],
                                                                                            Awaitable[bool]]]] = []
"""(kind, case, write garbage, is it gone)."""


def _entry(kind: str, name: str, key: str, field: bytes, value: bytes) -> None:
    async def write(r: aioredis.Redis, prefix: str) -> None:
        await r.hset(fleet_key(prefix, key), field, value)

    async def gone(r: aioredis.Redis, prefix: str) -> bool:
        return not await r.hexists(fleet_key(prefix, key), field)

    FLEET_CASES.append((kind, name, write, gone))


def _typed(kind: str, key: str, as_type: str, want: str) -> None:
    async def write(r: aioredis.Redis, prefix: str) -> None:
        await set_type(r, fleet_key(prefix, key), as_type)

    async def gone(r: aioredis.Redis, prefix: str) -> bool:
        return (await r.type(fleet_key(prefix, key))).decode() in (want, "none")

    FLEET_CASES.append((kind, f"a {as_type}", write, gone))


for _field, _value, _name in [
        (b"w\x1fc", b"garbage", "no colon"), (b"w\x1fc", b"1:abc", "deadline not a number"),
        (b"w\x1fc", b"x:1e30", "tokens not a number"), (b"w\x1fc", b"-5:1e30", "negative tokens"),
        (b"w\x1fc", b"5:nan", "deadline nan"), (b"w\x1fc", b"5:inf", "deadline inf"),
        (b"nosep", b"5:1e30", "field without a separator"), (b"\xff\x1fc", b"5:1e30", "field not utf-8"),
        (b"w\x1fc", b"5:1e30", "deadline centuries ahead"),
        (b"w\x1fc", b"1:" + HUGE, "huge"), (b"w\x1fc", b"9" * 40 + b":1e30", "tokens past any worker")]:
    _entry("reservation", _name, "reserved", _field, _value)
    _entry("parked", _name, "parked:fuzz", _field, _value)
for _t in ("string", "list", "zset"):
    _typed("reservation", "reserved", _t, "hash")
    _typed("parked", "parked:fuzz", _t, "hash")
    _typed("timer_token", "tokens", _t, "hash")
for _t in ("string", "hash", "list"):
    _typed("timer", "timers", _t, "zset")
    _typed("observation", "obs", _t, "stream")


def _timer(name: str, member: bytes, token: bytes | None) -> None:
    async def write(r: aioredis.Redis, prefix: str) -> None:
        await r.zadd(fleet_key(prefix, "timers"), {member: 0.0})
        if token is not None:
            await r.hset(fleet_key(prefix, "tokens"), member, token)

    async def gone(r: aioredis.Redis, prefix: str) -> bool:
        return await r.zscore(fleet_key(prefix, "timers"), member) is None

    FLEET_CASES.append(("timer", name, write, gone))


_timer("member without a separator", b"nosep", b"1")
_timer("member not utf-8", b"\xff\x1fsettle", b"1")
_timer("token not a number", b"c\x1fsettle", b"abc")
_timer("no token", b"c2\x1fsettle", None)
_timer("empty kind", b"c3\x1f", b"1")
_timer("huge member", b"c4\x1f" + HUGE, b"1")


def _obs(name: str, fields: dict[bytes, bytes]) -> None:
    async def write(r: aioredis.Redis, prefix: str) -> None:
        await r.xadd(fleet_key(prefix, "obs"), fields)

    async def gone(r: aioredis.Redis, prefix: str) -> bool:
        return all(f != fields for _, f in await r.xrange(fleet_key(prefix, "obs")))

    FLEET_CASES.append(("observation", name, write, gone))


_obs("not msgpack", {b"o": b"\xc1"})
_obs("truncated", {b"o": msgpack.packb({"k": "wait", "o": {"tenant": "t"}})[:5]})
_obs("no payload field", {b"x": b"1"})
_obs("a list", {b"o": msgpack.packb([1, 2])})
_obs("wait with a string figure", {b"o": msgpack.packb({"k": "wait", "o": {
    "tenant": "t", "tools": ["a"], "waited_s": "long", "predicted_s": 1.0}})})
_obs("wait negative", {b"o": msgpack.packb({"k": "wait", "o": {
    "tenant": "t", "tools": ["a"], "waited_s": -1.0, "predicted_s": 1.0}})})
_obs("wait nan", {b"o": msgpack.packb({"k": "wait", "o": {
    "tenant": "t", "tools": ["a"], "waited_s": float("nan"), "predicted_s": 1.0}})})
_obs("continuation tools a map", {b"o": msgpack.packb({"k": "continuation", "o": {
    "tenant": "t", "size": {}, "continued": True}})})
_obs("huge", {b"o": HUGE})


async def test_garbage_in_the_fleets_keys_is_dropped_and_the_runtimes_go_on(
        two: tuple[Cluster, str, aioredis.Redis]) -> None:
    c, prefix, r = two
    probe = RedisFleet(URL, prefix)
    """Another replica: it reserves, publishes and arms what both gateways must still see."""
    worker = WorkerId(gateway(c, 0).pool.all()[0].id)
    healed: Counter[str] = Counter()
    async with httpx.AsyncClient(timeout=30) as h:
        for n, (kind, name, write, gone) in enumerate(FLEET_CASES):
            await write(r, prefix)
            for url in c.urls:  # each ticks its runtime first
                tiers = await h.get(url + "/admin/tiers")
                assert tiers.status_code == 200, (kind, name, tiers.text)
            # A tenant's parked hash is read when the tenant reserves (below), not on a tick.
            assert kind == "parked" or await gone(r, prefix), (kind, name)
            cid = ConversationId(f"probe-{n}")
            assert await probe.reserve(worker, cid, 100 + n, time.time() + 60, tenant="fuzz", now=time.time(),
                                       budget=10_000)
            observed = [gateway(c, i).runtime.learned.waits.observed for i in (0, 1)]
            await probe.publish(WaitObserved("fuzz", ("probe",), 1.0, 1.0))
            await probe.arm(cid, "settle", 0.0, 7)
            for url in c.urls:
                tiers = await h.get(url + "/admin/tiers")
                assert tiers.json()["reserved"].get(worker, 0) >= 100 + n, (kind, name, tiers.json())
            assert all(gateway(c, i).runtime.learned.waits.observed > observed[i] for i in (0, 1)), (kind, name)
            assert await probe.reserved_by("fuzz", time.time()) == 100 + n, (kind, name)
            assert await gone(r, prefix), (kind, name)
            await probe.unreserve(worker, cid, tenant="fuzz")
            deadline = time.monotonic() + 5
            while await r.zscore(fleet_key(prefix, "timers"), f"{cid}\x1fsettle") is not None:
                assert time.monotonic() < deadline, (kind, name, "the timer was never claimed")
                await asyncio.sleep(0.02)
            healed[kind] += 1
    await probe.close()
    for i in (0, 1):
        loop = gateway(c, i).runtime._loop
        assert loop is not None and not loop.done()
    found: Counter[str] = Counter()
    for i in (0, 1):
        found.update(gateway(c, i).runtime.fleet.corruption.counts)
    assert all(found[k] for k in ("reservation", "timer", "timer_token", "observation")), found
    assert probe.corruption.counts["parked"] > 0
    cases = Counter(k for k, *_ in FLEET_CASES)
    for kind in sorted(cases):
        report(kind, cases[kind], healed[kind])


def report(kind: str, cases: int, healed: int) -> None:
    """The counts for the record (pytest -s shows them); every case must heal."""
    print(f"\nstore healing: {kind}: {cases} cases, {healed} healed")
    assert healed == cases
