"""The Redis session store against the real Redis on 127.0.0.1:6379."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis

from kvgate.config import GatewaySettings, WorkerConfig
from kvgate.gateway.app import create_app
from kvgate.kvstore.redis_sessions import RedisSessionStore, SessionStoreError
from kvgate.kvstore.sessions import Session, TurnRecord
from kvgate.router.types import ConversationId, WorkerId
from kvgate.serving import start_server
from tests.conftest import MODEL, free_port
from tests.test_gateway import client

URL = "redis://127.0.0.1:6379/0"


@pytest.fixture
async def prefix() -> AsyncIterator[str]:
    p = f"kvgate-test:{uuid.uuid4().hex[:8]}:"
    yield p
    r = aioredis.from_url(URL)
    keys = [k async for k in r.scan_iter(match=p + "*")]
    if keys:
        await r.delete(*keys)
    await r.aclose()


def turn(w: str) -> TurnRecord:
    return TurnRecord(WorkerId(w), "sticky", 100, 50, 5, 0.01, 48)


async def test_roundtrip_and_ttl_refresh(prefix: str) -> None:
    store = RedisSessionStore(URL, ttl_s=100, prefix=prefix)
    cid = ConversationId("c1")
    s = await store.update(cid, lambda cur: (cur or Session(cid, "body")).with_turn(turn("w1"), 1.0))
    assert s.version == 1 and s.home_worker == "w1"
    got = await store.peek(cid)
    assert got == s and got.turns[0].expected_cached_tokens == 48  # type: ignore[union-attr]
    r = aioredis.from_url(URL)
    await r.pexpire(prefix + "c1", 5000)
    await store.peek(cid)
    assert await r.pttl(prefix + "c1") <= 5000  # peek does not refresh
    await store.get(cid)
    assert await r.pttl(prefix + "c1") > 90_000  # get does
    await r.aclose()
    assert await store.count() == 1 and await store.delete(cid) and await store.peek(cid) is None
    await store.close()


async def test_two_gateways_never_lose_a_turn(prefix: str) -> None:
    a = RedisSessionStore(URL, prefix=prefix, max_retries=200)
    b = RedisSessionStore(URL, prefix=prefix, max_retries=200)
    cid = ConversationId("shared")

    async def add(store: RedisSessionStore, w: str) -> None:
        await store.update(cid, lambda cur: (cur or Session(cid, "header")).with_turn(turn(w), 0.0))

    await asyncio.gather(*(add(a if i % 2 else b, f"w{i % 3}") for i in range(60)))
    final = await a.peek(cid)
    assert final is not None and final.turn_count == 60 and final.version == 60
    await a.close()
    await b.close()


async def test_unreachable_redis_is_an_error_the_gateway_survives(make_cluster: Any) -> None:
    store = RedisSessionStore(f"redis://127.0.0.1:{free_port()}/0")
    with pytest.raises(SessionStoreError):
        await store.get(ConversationId("x"))
    c = await make_cluster(1, session_store="redis", redis_url=f"redis://127.0.0.1:{free_port()}/0")
    r = await client(c).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=2, extra_headers={"x-conversation-id": "down"})
    assert r.choices
    async with httpx.AsyncClient() as h:
        text = (await h.get(c.url + "/metrics")).text
    # The read, the write and the scrape's count all failed, and everything was still answered.
    assert "kvgate_session_store_errors_total 3.0" in text


async def test_conversation_moves_between_gateway_replicas(make_cluster: Any, prefix: str) -> None:
    c = await make_cluster(3, policy="session_affinity", session_store="redis", redis_url=URL)
    settings = GatewaySettings(workers=[WorkerConfig(url=h.url, model=MODEL, engine="sim") for _, h in c.sims],
                               policy="session_affinity", session_store="redis", redis_url=URL,
                               health_interval_s=0.2)
    other = await start_server(create_app(settings))
    try:
        conv = f"{prefix}replica"
        oc_a = client(c)
        raw = await oc_a.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": "start"}], max_tokens=2,
            extra_headers={"x-conversation-id": conv})
        home = raw.headers["x-kvgate-worker"]
        import openai

        oc_b = openai.AsyncOpenAI(base_url=other.url + "/v1", api_key="x", max_retries=0)
        for _ in range(3):
            raw = await oc_b.chat.completions.with_raw_response.create(
                model=MODEL, messages=[{"role": "user", "content": "go on"}], max_tokens=2,
                extra_headers={"x-conversation-id": conv})
            assert raw.headers["x-kvgate-worker"] == home
            assert raw.headers["x-kvgate-route-reason"] == "session_affinity:sticky"
    finally:
        await other.stop()
        r = aioredis.from_url(URL)
        await r.delete(f"kvgate:session:{prefix}replica")
        await r.aclose()
