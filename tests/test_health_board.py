"""Worker ejections shared by the replicas (kvstore/health.py, gateway/workers.py): three replicas on one
Redis, a worker only one of them saw fail."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import httpx
from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse

from kvgate.assembly import create_app
from kvgate.config import GatewaySettings, WorkerConfig
from kvgate.kvstore.health import parse
from kvgate.serving import start_server
from tests.conftest import MODEL

REDIS = "redis://127.0.0.1:6379/0"


def failing_worker() -> FastAPI:
    """Healthy to its checks, failing every request: only a replica that sends it one can tell."""
    app = FastAPI()

    @app.get("/health")
    async def health() -> PlainTextResponse:
        return PlainTextResponse("")

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse("")

    @app.post("/v1/chat/completions")
    async def chat() -> JSONResponse:
        return JSONResponse({"error": {"message": "engine overloaded", "code": 503}}, status_code=503)

    return app


async def until(pred: Any, timeout_s: float) -> float:
    start = time.monotonic()
    while not pred():
        assert time.monotonic() - start < timeout_s, "not within the time"
        await asyncio.sleep(0.02)
    return time.monotonic() - start


def gateways(c: Any) -> list[Any]:
    return [r.server.config.app.state.gateway for r in c.replicas]


async def test_a_worker_one_replica_ejected_is_ejected_by_the_others_and_a_joiner(make_cluster: Any) -> None:
    bad = await start_server(failing_worker())
    prefix = f"kvt-health-{uuid.uuid4().hex[:8]}:"
    extra = {"url": bad.url, "model": MODEL, "engine": "sim", "block_size": 16}
    try:
        c = await make_cluster(1, replicas=3, session_store="redis", redis_url=REDIS, redis_prefix=prefix,
                               health_interval_s=0.5, eject_after_failures=1, policy="round_robin",
                               extra_workers=[extra])
        bad_id = f"127.0.0.1:{bad.port}"
        gws = gateways(c)
        assert all(g.pool.get(bad_id).healthy for g in gws)
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        async with httpx.AsyncClient() as h:
            for _ in range(4):  # round robin: one of them lands on the failing worker, then is retried
                assert (await h.post(c.urls[0] + "/v1/chat/completions", json=body)).status_code == 200
        assert not gws[0].pool.get(bad_id).healthy
        took = await until(lambda: all(g.pool.learned_ejections >= 1 for g in gws[1:]), timeout_s=3.0)
        assert took < 1.5  # within the others' next round of checks (0.5 s here)
        # A replica that joins now learns it before it serves.
        settings = GatewaySettings(workers=[WorkerConfig(**extra)], session_store="redis", redis_url=REDIS,
                                   redis_prefix=prefix, health_interval_s=30, hash_seed="0")
        late = await start_server(create_app(settings))
        try:
            lg = late.server.config.app.state.gateway
            assert not lg.pool.get(bad_id).healthy and lg.pool.learned_ejections == 1
        finally:
            await late.stop()
    finally:
        await bad.stop()


async def test_a_killed_worker_is_avoided_by_all_three_within_the_health_interval(make_cluster: Any) -> None:
    c = await make_cluster(2, replicas=3, session_store="redis", redis_url=REDIS,
                           redis_prefix=f"kvt-health-{uuid.uuid4().hex[:8]}:", health_interval_s=0.5)
    _, handle = c.sims[0]
    wid = f"127.0.0.1:{handle.port}"
    gws = gateways(c)
    assert all(g.pool.get(wid).healthy for g in gws)
    await handle.kill()
    took = await until(lambda: not any(g.pool.get(wid).healthy for g in gws), timeout_s=3.0)
    assert took < 1.0


def test_entries_not_written_by_kvgate_are_refused() -> None:
    assert parse(b"1700000000.5|abc") == (1700000000.5, "abc")
    for bad in (b"", b"nan|x", b"-1|x", b"12", b"12|", b"\xff|x", b"x|y"):
        assert parse(bad) is None
