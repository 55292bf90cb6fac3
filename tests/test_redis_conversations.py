"""The Redis conversation store against the real Redis on 127.0.0.1:6379 and a real three-node Redis
Cluster on loopback."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace

import msgpack
import pytest
import redis.asyncio as aioredis

from kvgate.kvstore.conversations import StoreError
from kvgate.kvstore.redis_conversations import RedisConversationStore
from kvgate.router.types import ConversationId, WorkerId
from kvgate.session.conversation import Conversation, Limits, TurnRecord
from tests.conftest import free_port
from tests.redis_cluster import redis_cluster  # noqa: F401  (a fixture)

URL = "redis://127.0.0.1:6379/0"


@pytest.fixture(params=["single", "cluster"])
async def store_url(request: pytest.FixtureRequest) -> AsyncIterator[tuple[str, bool, str]]:
    cluster = request.param == "cluster"
    url = request.getfixturevalue("redis_cluster") if cluster else URL
    prefix = f"kvgate-test:{uuid.uuid4().hex[:8]}:"
    yield url, cluster, prefix
    if not cluster:
        r = aioredis.from_url(URL)
        keys = [k async for k in r.scan_iter(match=prefix + "*")]
        if keys:
            await r.delete(*keys)
        await r.aclose()


def turn(w: str) -> TurnRecord:
    return TurnRecord(WorkerId(w), "sticky", 100, 50, 5, 0.01, 48)


def add_turn(cid: ConversationId, w: str):  # type: ignore[no-untyped-def]
    return lambda cur: (cur or Conversation(cid, "t", "header")).with_turn(turn(w), Limits())


async def test_roundtrip_body_and_ttl_refresh(store_url: tuple[str, bool, str]) -> None:
    url, cluster, prefix = store_url
    store = RedisConversationStore(url, ttl_s=100, prefix=prefix, cluster=cluster)
    cid = ConversationId("t/c1")
    s = await store.update(cid, add_turn(cid, "w1"))
    assert s is not None and s.version == 1 and s.home == "w1"
    reply = {"role": "assistant", "content": "ok"}
    s2 = await store.update(cid, lambda cur: cur.with_reply("m", ({"role": "user", "content": "q"},), reply, None,
                                                            None, "resp-9", Limits()) if cur else None)
    assert s2 is not None and s2.body_gen == 1
    fresh = RedisConversationStore(url, ttl_s=100, prefix=prefix, cluster=cluster)  # another replica
    got = await fresh.peek(cid)
    assert got == s2 and got.history[-1] == reply  # type: ignore[union-attr]
    assert await fresh.conversation_of("resp-9") == cid
    head = f"{prefix}{{{cid}}}:h"
    await fresh._r.pexpire(head, 5000)  # type: ignore[union-attr]
    await fresh.peek(cid)
    assert await fresh._r.pttl(head) <= 5000  # peek does not refresh  # type: ignore[union-attr]
    await fresh.get(cid)
    assert await fresh._r.pttl(head) > 90_000  # get does  # type: ignore[union-attr]
    assert await store.delete(cid) and await fresh.peek(cid) is None
    await store.close()
    await fresh.close()


async def test_two_replicas_never_lose_a_turn(store_url: tuple[str, bool, str]) -> None:
    url, cluster, prefix = store_url
    a = RedisConversationStore(url, prefix=prefix, cluster=cluster, max_retries=200)
    b = RedisConversationStore(url, prefix=prefix, cluster=cluster, max_retries=200)
    cid = ConversationId("shared")
    await asyncio.gather(*(( a if i % 2 else b).update(cid, add_turn(cid, f"w{i % 3}")) for i in range(40)))
    final = await a.peek(cid)
    assert final is not None and final.turn_count == 40 and final.version == 40
    await a.close()
    await b.close()


async def test_a_replica_reads_the_body_only_when_it_changed(store_url: tuple[str, bool, str]) -> None:
    url, cluster, prefix = store_url
    a = RedisConversationStore(url, prefix=prefix, cluster=cluster)
    b = RedisConversationStore(url, prefix=prefix, cluster=cluster)
    cid = ConversationId("body")
    big = {"role": "user", "content": "x" * 100_000}
    await a.update(cid, lambda cur: Conversation(cid).with_reply("m", (big,), {"role": "assistant", "content": "a"},
                                                                  None, None, None, Limits()))
    await b.get(cid)
    before = b.bytes_read
    await a.update(cid, add_turn(cid, "w1"))  # the head changes, the body does not
    got = await b.get(cid)
    assert got is not None and got.turn_count == 1 and got.history[0] == big
    assert b.bytes_read - before < 10_000
    await a.close()
    await b.close()


async def test_the_bodies_a_replica_keeps_are_bounded_by_bytes() -> None:
    """Fails on a0afb21: 10,000 bodies were kept whatever their size."""
    prefix = f"kvgate-test:{uuid.uuid4().hex[:8]}:"
    store = RedisConversationStore(URL, prefix=prefix, cached_bytes=1 << 20)
    big = {"role": "user", "content": "x" * 200_000}
    for i in range(10):
        cid = ConversationId(f"big-{i}")
        await store.update(cid, lambda cur, cid=cid: Conversation(cid).with_reply(  # type: ignore[misc]
            "m", (big,), {"role": "assistant", "content": "a"}, None, None, None, Limits()))
    assert store.stats()["cached_bytes"] <= 1 << 20 and 2 <= store.stats()["cached_bodies"] <= 5
    got = await store.get(ConversationId("big-0"))  # no longer kept: read whole again
    assert got is not None and got.history[0] == big
    r = aioredis.from_url(URL)
    await r.delete(*[k async for k in r.scan_iter(match=prefix + "*")])
    await r.aclose()
    await store.close()


async def test_two_schema_versions_share_one_redis() -> None:
    """A newer replica writes a field this one does not know; this one updates the record and the
    newer replica still finds its field."""
    prefix = f"kvgate-test:{uuid.uuid4().hex[:8]}:"
    store = RedisConversationStore(URL, prefix=prefix)
    cid = ConversationId("v")
    await store.update(cid, add_turn(cid, "w1"))
    r = aioredis.from_url(URL)
    key = f"{prefix}{{{cid}}}:h"
    head = msgpack.unpackb(await r.hget(key, "data"), raw=False)
    head["schema"], head["tenant_priority"] = 2, "batch"
    await r.hset(key, "data", msgpack.packb(head, use_bin_type=True))
    other = RedisConversationStore(URL, prefix=prefix)  # the older replica, with an empty cache
    await other.update(cid, add_turn(cid, "w2"))
    head = msgpack.unpackb(await r.hget(key, "data"), raw=False)
    assert head["tenant_priority"] == "batch" and head["turn_count"] == 2
    await r.delete(key, f"{prefix}{{{cid}}}:b")
    await r.aclose()
    await store.close()
    await other.close()


async def test_unreachable_is_a_store_error_and_corrupt_is_reset_by_the_next_write() -> None:
    """Fails on a0afb21: a corrupt record was a StoreError on every read and write until it expired."""
    down = RedisConversationStore(f"redis://127.0.0.1:{free_port()}/0")
    with pytest.raises(StoreError):
        await down.get(ConversationId("x"))
    prefix = f"kvgate-test:{uuid.uuid4().hex[:8]}:"
    store = RedisConversationStore(URL, prefix=prefix)
    r = aioredis.from_url(URL)
    cid = ConversationId("bad")
    await r.hset(f"{prefix}{{bad}}:h", mapping={"ver": "1", "data": b"\xc1garbage"})
    assert await store.get(cid) is None
    peeked = await store.peek(cid)
    assert peeked is not None and peeked.reset.startswith("not msgpack")
    assert store.corruption.counts["conversation"] == 1  # read twice, counted once
    healed = await store.update(cid, add_turn(cid, "w1"), known=None)
    assert healed is not None and healed.turn_count == 1 and healed.version == 2 and healed.reset
    fresh = await RedisConversationStore(URL, prefix=prefix).get(cid)
    assert fresh == healed and fresh.reset == healed.reset  # type: ignore[union-attr]
    await r.delete(f"{prefix}{{bad}}:h", f"{prefix}{{bad}}:b")
    await r.aclose()
    await store.close()
    await down.close()


def test_record_defaults() -> None:
    assert replace(Conversation(ConversationId("x")), tenant="t").version == 0
