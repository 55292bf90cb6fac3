"""gateway/looplag.py and what follows from a late loop: no worker blamed, new requests shed."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from typing import Any

import httpx
import pytest

from kvgate.clock import MonotonicClock
from kvgate.config import WorkerConfig
from kvgate.gateway.looplag import LoopLag
from kvgate.gateway.upstream import AiohttpUpstream
from kvgate.gateway.workers import WorkerPool
from tests.conftest import MODEL


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_the_worst_lateness_is_kept_for_its_window_only() -> None:
    clock = Clock()
    lag = LoopLag(bucket_s=0.25, window_s=10.0, clock=clock)
    lag.record(clock.t, 0.8)
    lag.record(clock.t + 0.1, 0.01)
    assert lag.worst(clock.t + 0.1, 1.0) == 0.8
    clock.t += 5.0
    lag.record(clock.t, 0.02)
    assert lag.worst(clock.t, 1.0) == 0.02
    assert lag.worst(clock.t, 6.0) == 0.8


def test_a_timeout_is_the_loops_when_it_was_late_by_a_fair_part_of_it() -> None:
    clock = Clock()
    lag = LoopLag(clock=clock)
    lag.record(clock.t, 0.5)
    assert lag.blames_loop(timeout_s=1.0) and not lag.blames_loop(timeout_s=3.0)
    clock.t += 2.0  # the late moment is outside a 1 s timeout's window now
    assert not lag.blames_loop(timeout_s=1.0)


def test_shedding_holds_then_stops() -> None:
    clock = Clock()
    lag = LoopLag(clock=clock)
    lag.record(clock.t, 0.2)
    assert lag.overloaded(0.05)
    clock.t += 0.3
    lag.record(clock.t, 0.001)
    assert lag.overloaded(0.05)  # still within the hold
    clock.t += 0.6
    lag.record(clock.t, 0.001)
    assert not lag.overloaded(0.05)


async def test_the_ticker_sees_a_blocked_loop() -> None:
    lag = LoopLag(interval_s=0.01)
    task = asyncio.create_task(lag.run())
    await asyncio.sleep(0.05)
    asyncio.get_running_loop().call_soon(time.sleep, 0.3)  # a long synchronous step holds every timer up
    await asyncio.sleep(0.05)
    task.cancel()
    assert lag.worst(time.monotonic(), 1.0) >= 0.25


def test_a_connect_timeout_on_a_late_loop_does_not_eject_the_worker() -> None:
    clock = Clock()
    lag = LoopLag(clock=clock)
    pool = WorkerPool([WorkerConfig(url="http://127.0.0.1:9", model=MODEL)], httpx.AsyncClient(), MonotonicClock(),
                      fall=2)
    pool.blames_loop = lag.blames_loop
    pool.connect_timeout_s = 1.0
    (w,) = pool.all()
    w.health.success()  # up, as after its first check
    lag.record(clock.t, 0.6)
    for _ in range(5):
        pool.mark_failed(w.id, "connect timed out", "ConnectTimeout")
    assert pool.get(w.id).healthy and pool.loop_blamed == 5
    clock.t += 10  # the loop is on time again: the same timeouts are the worker's
    for _ in range(2):
        pool.mark_failed(w.id, "connect timed out", "ConnectTimeout")
    assert not pool.get(w.id).healthy


async def test_requests_are_shed_while_the_loop_is_late_and_health_answers(make_cluster: Any) -> None:
    c = await make_cluster(1, overload_shed_lag_ms=50)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    async with httpx.AsyncClient(base_url=c.url) as h:
        c.gateway.loop_lag.record(time.monotonic(), 0.2)
        r = await h.post("/v1/chat/completions", json=body)
        assert r.status_code == 503 and r.json()["error"]["code"] == "overloaded" and r.headers["retry-after"]
        assert (await h.get("/health")).status_code == 200
        lag = next(line for line in (await h.get("/metrics")).text.splitlines()
                   if line.startswith("kvgate_event_loop_lag_seconds "))
        assert float(lag.split()[1]) >= 0.2, lag
        # Once the loop is on time for the hold, requests go through again (this machine's own load may
        # keep it late for a while: wait for it rather than for a fixed time).
        deadline = time.monotonic() + 30
        while (r := await h.post("/v1/chat/completions", json=body)).status_code == 503:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.2)
        assert r.status_code == 200


async def test_every_door_refuses_at_the_connection_as_its_app_would(make_cluster: Any) -> None:
    """The connection's refusal (kvgate/connections.Shedding) is the door's own: the same status, body and
    Retry-After as ``Proxy.handle`` gives a request that reaches the app while the loop is late (an
    Anthropic-shaped error on /v1/messages, OpenAI's elsewhere), and it is counted the same."""
    c = await make_cluster(1, overload_shed_lag_ms=50)
    app = c.gateway_handle.server.config.app
    bodies = {"/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
              "/v1/completions": {"model": MODEL, "prompt": "hi"},
              "/v1/responses": {"model": MODEL, "input": "hi"},
              "/v1/messages": {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}}
    shed = c.gateway.metrics.shed
    async with httpx.AsyncClient(base_url=c.url) as wire, \
            httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app") as inside:
        for path, body in bodies.items():
            c.gateway.loop_lag.record(time.monotonic(), 0.2)
            before = shed._value.get()
            at_connection = await wire.post(path, json=body)
            in_app = await inside.post(path, json=body)
            assert at_connection.status_code == in_app.status_code == 503, path
            assert at_connection.content == in_app.content, path
            assert at_connection.headers["retry-after"] == in_app.headers["retry-after"], path
            assert shed._value.get() == before + 2, path
    assert json.loads(at_connection.content)["error"]["type"] == "overloaded_error"


async def _keepalive_racer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """A worker that answers a connection's first request and closes the connection when a second one
    arrives on it: the moment a keep-alive timeout closes an idle connection as the client reuses it."""
    served = 0
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length")), 0)
            await reader.readexactly(length)
            if served:
                writer.close()
                return
            served += 1
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}")
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        writer.close()


async def test_a_request_on_a_connection_the_worker_just_closed_is_sent_again() -> None:
    server = await asyncio.start_server(_keepalive_racer, "127.0.0.1", 0, family=socket.AF_INET)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/chat/completions"
    up = AiohttpUpstream(connect_timeout_s=1.0, read_timeout_s=5.0)
    try:
        for _ in range(3):
            resp = await up.post(url, b"{}", {"content-type": "application/json"})
            assert resp.status == 200 and await resp.read() == b"{}"
            await resp.close()
    finally:
        await up.aclose()
        server.close()


@pytest.mark.parametrize("kind", ["ConnectError"])
def test_a_refused_connection_still_ejects_at_once(kind: str) -> None:
    lag = LoopLag(clock=Clock())
    lag.record(1000.0, 5.0)
    pool = WorkerPool([WorkerConfig(url="http://127.0.0.1:9", model=MODEL)], httpx.AsyncClient(), MonotonicClock())
    pool.blames_loop = lag.blames_loop
    (w,) = pool.all()
    w.health.success()
    pool.mark_failed(w.id, "refused", kind)
    assert not pool.get(w.id).healthy
