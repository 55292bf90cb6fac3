"""Admission through a real gateway (issue 11 part 3): 429 over a tenant limit and 503 when the fleet's
queue is full or the wait too long, both with Retry-After and OpenAI's error shape; slots and leases
given back when a stream ends or its client leaves; a refused request writes nothing; two replicas on one
Redis share a tenant's limits."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis

from kvgate.admission.gate import Admission
from kvgate.router.types import ConversationId
from tests.conftest import MODEL, Cluster
from tests.helpers import eventually

REDIS = "redis://127.0.0.1:6379/0"
SLOW = {"speed": 1.0, "profile": "cpu-tiny"}
"""Timing of the tiny model on CPU: 2000 reasoning tokens stream for seconds, long enough to hold a slot
while a test looks; the test ends the stream itself, so nothing waits for it."""
LONG = {"sim": {"reasoning_tokens": 2000, "answer_tokens": 4}}


def body(content: str = "hello", stream: bool = False, **kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "stream": stream, **kw}


def headers(tenant: str, conv: str | None = None, **kw: str) -> dict[str, str]:
    return {"x-tenant-id": tenant, **({"x-conversation-id": conv} if conv else {}), **kw}


def gate(c: Cluster, i: int = 0) -> Admission:
    gw = c.replicas[i].server.config.app.state.gateway
    assert gw.admission is not None
    a: Admission = gw.admission
    return a


@asynccontextmanager
async def held_stream(h: httpx.AsyncClient, url: str, tenant: str) -> AsyncIterator[None]:
    """A long stream that has started (its first output arrived); leaving the block disconnects it."""
    async with h.stream("POST", url + "/v1/chat/completions", json=body(stream=True, **LONG),
                        headers=headers(tenant)) as r:
        assert r.status_code == 200
        lines = r.aiter_lines()  # held: an iterator dropped after ``break`` is finalised, closing the stream
        async for line in lines:
            if '"reasoning"' in line:
                break
        yield
        await lines.aclose()


async def test_over_a_tenant_limit_is_429_with_retry_after_and_writes_nothing(make_cluster: Any) -> None:
    c = await make_cluster(1, admission={"enabled": True, "defaults": {"requests_per_minute": 2}})
    async with httpx.AsyncClient(base_url=c.url, timeout=30) as h:
        for i in range(2):
            r = await h.post("/v1/chat/completions", json=body(), headers=headers("acme", f"ok{i}"))
            assert r.status_code == 200, r.text
        r = await h.post("/v1/chat/completions", json=body(), headers=headers("acme", "refused"))
        assert r.status_code == 429
        assert 1 <= int(r.headers["retry-after"]) <= 30  # one request a 30 s at 2 a minute
        err = r.json()["error"]
        assert err["type"] == "requests" and err["code"] == "rate_limit_exceeded" and err["param"] is None
        assert "requests per minute" in err["message"] and "Limit 2" in err["message"]
        # Another tenant has its own bucket.
        assert (await h.post("/v1/chat/completions", json=body(), headers=headers("other"))).status_code == 200
    store = c.gateway.store
    assert await store.get(ConversationId("acme/ok0")) is not None
    assert await store.get(ConversationId("acme/refused")) is None
    assert gate(c).rejected == {"requests_per_minute": 1}


async def test_tokens_per_minute_counts_prompt_tokens(make_cluster: Any) -> None:
    # "word " is ~3 tokens of the tiny model: 100 of them ~310 prompt tokens, 200 ~610.
    c = await make_cluster(1, admission={"enabled": True, "defaults": {"tokens_per_minute": 400}})
    async with httpx.AsyncClient(base_url=c.url, timeout=30) as h:
        r = await h.post("/v1/chat/completions", json=body("word " * 100), headers=headers("t"))
        assert r.status_code == 200
        r = await h.post("/v1/chat/completions", json=body("word " * 100), headers=headers("t"))
        assert r.status_code == 429 and r.json()["error"]["type"] == "tokens"
        assert "retry-after" in r.headers
        r = await h.post("/v1/chat/completions", json=body("word " * 200), headers=headers("u"))
        assert r.status_code == 429 and "retry-after" not in r.headers  # more than a minute's tokens: never
        assert "Request too large" in r.json()["error"]["message"]
        r = await h.post("/v1/chat/completions", json=body(), headers=headers("t", **{"x-kvgate-priority": "soon"}))
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_priority"


async def test_queue_full_is_503_and_a_disconnect_gives_the_slot_to_the_next(make_cluster: Any) -> None:
    c = await make_cluster(1, sim=SLOW, admission={"enabled": True, "worker_slots": 1, "queue_size": 1,
                                                   "max_queue_wait_s": 60, "defaults": {"max_concurrent": 5}})
    a = gate(c)
    async with httpx.AsyncClient(base_url=c.url, timeout=60) as h:
        async with held_stream(h, c.url, "heavy"):
            assert a.busy(MODEL) == 1
            queued = asyncio.create_task(h.post("/v1/chat/completions", json=body(), headers=headers("light")))
            await eventually(lambda: a.queued(MODEL) == 1)
            r = await h.post("/v1/chat/completions", json=body(), headers=headers("light"))
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            assert r.json()["error"] == {"message": f"The admission queue for model `{MODEL}` is full. Retry later.",
                                         "type": "service_unavailable", "param": None, "code": "queue_full"}
            assert not queued.done()
        # The held stream's client left: its slot goes to the queued request.
        assert (await queued).status_code == 200
        await eventually(lambda: a.busy(MODEL) == 0)
        # A stream read to its end gives its slot back too.
        async with h.stream("POST", "/v1/chat/completions", json=body(stream=True), headers=headers("t")) as r:
            assert r.status_code == 200
            assert any([line async for line in r.aiter_lines() if line == "data: [DONE]"])
        await eventually(lambda: a.busy(MODEL) == 0)
    assert not a._held  # every concurrency lease released


async def test_waiting_too_long_is_503(make_cluster: Any) -> None:
    c = await make_cluster(1, sim=SLOW, admission={"enabled": True, "worker_slots": 1, "max_queue_wait_s": 0.2})
    async with httpx.AsyncClient(base_url=c.url, timeout=60) as h:
        async with held_stream(h, c.url, "a"):
            r = await h.post("/v1/chat/completions", json=body(), headers=headers("b", "late"))
            assert r.status_code == 503 and r.json()["error"]["code"] == "queue_timeout"
            assert int(r.headers["retry-after"]) >= 1
    assert await c.gateway.store.get(ConversationId("b/late")) is None
    await eventually(lambda: gate(c).busy(MODEL) == 0)


@pytest.fixture
async def prefix() -> AsyncIterator[str]:
    p = f"kvgate-test-adm:{uuid.uuid4().hex[:8]}:"
    yield p
    r = aioredis.from_url(REDIS)
    keys = [k async for k in r.scan_iter(match=f"{p}*")]
    if keys:
        await r.delete(*keys)
    await r.aclose()


async def test_two_replicas_on_one_redis_share_a_tenants_limits(make_cluster: Any, prefix: str) -> None:
    c = await make_cluster(1, sim=SLOW, replicas=2, session_store="redis", redis_url=REDIS, redis_prefix=prefix,
                           admission={"enabled": True, "defaults": {"requests_per_minute": 4},
                                      "tenants": {"solo": {"max_concurrent": 1, "requests_per_minute": 100}}})
    async with httpx.AsyncClient(timeout=60) as h:
        codes = [(await h.post(c.urls[i % 2] + "/v1/chat/completions", json=body(),
                               headers=headers("acme"))).status_code for i in range(5)]
        assert codes == [200, 200, 200, 200, 429]  # four a minute between both replicas, not four each
        r = await h.post(c.urls[0] + "/v1/chat/completions", json=body(), headers=headers("acme"))
        assert r.status_code == 429
        # One concurrent request for "solo", wherever it lands.
        async with held_stream(h, c.urls[0], "solo"):
            r = await h.post(c.urls[1] + "/v1/chat/completions", json=body(), headers=headers("solo"))
            assert r.status_code == 429 and r.json()["error"]["type"] == "concurrent_requests"
        # The stream's client left: its lease is released (off the request's path, so eventually).
        store = gate(c, 0).store

        async def free() -> bool:
            return await store.leases("solo") == 0  # type: ignore[attr-defined, no-any-return]

        await eventually(free)
        r = await h.post(c.urls[1] + "/v1/chat/completions", json=body(), headers=headers("solo"))
        assert r.status_code == 200


@pytest.mark.parametrize("send", [True, False])
async def test_the_class_goes_to_vllm_workers_as_priority_only_when_configured(make_cluster: Any, send: bool) -> None:
    c = await make_cluster(1, admission={"enabled": True, "worker_priority": send, "batch_priority": 7})
    preparer = c.gateway.proxy.preparer
    for value, expected in (("batch", 7), ("interactive", 0), (None, 0)):
        h = {"x-tenant-id": "t", **({"x-kvgate-priority": value} if value else {})}
        p = await preparer.prepare_body(body(priority=-5), h, "chat", act=False, admit=True)
        assert p.ticket is not None
        p.ticket.release()
        sent = json.loads(p.payload)
        # On: kvgate's value replaces the client's (it would otherwise jump the queue); off: the client's.
        assert sent["priority"] == (expected if send else -5)


async def test_success_carries_openai_ratelimit_headers_and_completions_count(make_cluster: Any) -> None:
    c = await make_cluster(1, admission={"enabled": True,
                                         "defaults": {"requests_per_minute": 10, "tokens_per_minute": 600}})
    async with httpx.AsyncClient(base_url=c.url, timeout=30) as h:
        r = await h.post("/v1/chat/completions", json=body("word " * 100), headers=headers("t"))
        assert r.status_code == 200, r.text
        prompt = r.json()["usage"]["prompt_tokens"]
        assert r.headers["x-ratelimit-limit-requests"] == "10" and r.headers["x-ratelimit-remaining-requests"] == "9"
        assert r.headers["x-ratelimit-limit-tokens"] == "600"
        # The prompt as counted, not as estimated from its characters.
        assert int(r.headers["x-ratelimit-remaining-tokens"]) == 600 - prompt
        assert r.headers["x-ratelimit-reset-requests"].endswith("s")
        completion = r.json()["usage"]["completion_tokens"]
        store = gate(c).store

        async def charged() -> bool:
            left = await store.level("t", "tokens", 600)
            return bool(left <= 600 - prompt - completion + 15)  # refilled 10 tokens a second meanwhile

        await eventually(charged)
        # A tenant without rate limits gets no such headers.
        c2 = await make_cluster(1, admission={"enabled": True, "defaults": {"max_concurrent": 3}})
        r = await h.post(c2.url + "/v1/chat/completions", json=body(), headers=headers("t"))
        assert r.status_code == 200 and not any(k.startswith("x-ratelimit") for k in r.headers)


async def test_a_client_that_leaves_while_queued_frees_its_place(make_cluster: Any) -> None:
    c = await make_cluster(1, sim=SLOW, admission={"enabled": True, "worker_slots": 1, "queue_size": 1,
                                                   "max_queue_wait_s": 60})
    a = gate(c)
    async with httpx.AsyncClient(base_url=c.url, timeout=60) as h:
        async with held_stream(h, c.url, "heavy"):
            leaving = asyncio.create_task(h.post("/v1/chat/completions", json=body(), headers=headers("gone")))
            await eventually(lambda: a.queued(MODEL) == 1)
            leaving.cancel()  # the connection closes while the request waits for a slot
            with pytest.raises(asyncio.CancelledError):
                await leaving
            await eventually(lambda: a.queued(MODEL) == 0)  # not after max_queue_wait_s
            queued = asyncio.create_task(h.post("/v1/chat/completions", json=body(), headers=headers("next")))
            await eventually(lambda: a.queued(MODEL) == 1)  # the place is free for the next one
        assert (await queued).status_code == 200
    assert await c.gateway.store.get(ConversationId("gone/x")) is None
