"""Workers that die, and a gateway that drains: real processes, killed with real signals."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from kvgate.assembly import create_app
from kvgate.config import GatewaySettings, WorkerConfig
from kvgate.serving import start_server
from kvgate.sim.server import SimWorker
from kvgate.sim.settings import SimSettings
from tests.conftest import MODEL, free_port
from tests.helpers import TOOLS, metric, start_sims


async def test_worker_killed_between_turns_next_turn_served_elsewhere(spawn: Any, model_dir: Path) -> None:
    sims = await start_sims(spawn, model_dir, 3, "--speed", "20")
    settings = GatewaySettings(workers=[WorkerConfig(url=u, model=MODEL, engine="sim") for _, u in sims],
                               health_interval_s=30,  # the health check must not be what saves us
                               policy="session_affinity")
    gw = await start_server(create_app(settings))
    try:
        oc = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
        msgs: list[dict[str, Any]] = [{"role": "user", "content": "investigate"}]
        raw = await oc.chat.completions.with_raw_response.create(model=MODEL, messages=msgs, tools=TOOLS,  # type: ignore[arg-type]
                                                                 extra_headers={"x-conversation-id": "k"})
        home = raw.headers["x-kvgate-worker"]
        m = raw.parse().choices[0].message
        msgs += [m.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": m.tool_calls[0].id, "content": "out"}]  # type: ignore[index]
        victim = next(p for p, u in sims if u.endswith(home.split(":")[1]))
        victim.signal(signal.SIGKILL)
        victim.popen.wait(timeout=10)
        raw2 = await oc.chat.completions.with_raw_response.create(model=MODEL, messages=msgs, tools=TOOLS,  # type: ignore[arg-type]
                                                                  extra_headers={"x-conversation-id": "k"})
        assert raw2.http_response.status_code == 200
        assert raw2.headers["x-kvgate-worker"] != home
        assert "session_affinity:home_unavailable" == raw2.headers["x-kvgate-route-reason"]
        app_gw = gw.server.config.app.state.gateway
        assert not app_gw.pool.get(home).healthy
        async with httpx.AsyncClient() as h:
            text = (await h.get(gw.url + "/metrics")).text
        assert "kvgate_retries_total 1.0" in text
        # The next turn stays on its new home.
        raw3 = await oc.chat.completions.with_raw_response.create(model=MODEL, messages=msgs, max_tokens=2,
                                                                  extra_headers={"x-conversation-id": "k"})
        assert raw3.headers["x-kvgate-worker"] == raw2.headers["x-kvgate-worker"]
    finally:
        await gw.stop()


async def test_worker_killed_mid_stream_ends_with_sse_error(spawn: Any, model_dir: Path) -> None:
    sims = await start_sims(spawn, model_dir, 1, "--speed", "1", "--profile", "cpu-tiny")
    settings = GatewaySettings(workers=[WorkerConfig(url=sims[0][1], model=MODEL, engine="sim")],
                               health_interval_s=30)
    gw = await start_server(create_app(settings))
    try:
        oc = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
        stream = await oc.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                                  stream=True, extra_body={"sim": {"reasoning_tokens": 2000}})
        got = 0
        with pytest.raises(openai.APIError, match="failed mid-stream"):
            async for _ in stream:
                got += 1
                if got == 3:
                    sims[0][0].signal(signal.SIGKILL)
        assert got >= 3
        c = type("C", (), {"url": gw.url})()
        assert await metric(c, "kvgate_upstream_failures_total", kind="stream_broken") == 1  # type: ignore[arg-type]
    finally:
        await gw.stop()


async def test_sigterm_drains_in_flight_requests(spawn: Any, model_dir: Path) -> None:
    w = SimWorker(SimSettings(model_dir=str(model_dir), speed=1.0, profile="cpu-tiny"))
    sim = await start_server(w.build_app())
    port = free_port()
    gwp = spawn("serve", "--port", str(port), "--worker", f"{sim.url}={MODEL}@sim",
                env={"KVGATE_DRAIN_TIMEOUT_S": "20"})
    url = f"http://127.0.0.1:{port}"
    try:
        await gwp.wait_http(url + "/ready")
        async with httpx.AsyncClient(timeout=30) as h:
            body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                    "sim": {"reasoning_tokens": 300, "answer_tokens": 5}}
            slow = asyncio.create_task(h.post(url + "/v1/chat/completions", json=body))
            await asyncio.sleep(0.4)
            assert not slow.done()
            gwp.signal(signal.SIGTERM)
            r = await slow
            assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "stop"
        gwp.popen.wait(timeout=20)
        assert "invalid" not in gwp.tail()
    finally:
        await sim.stop()


async def test_bad_config_exits_with_clear_message(spawn: Any) -> None:
    p = spawn("serve", env={"KVGATE_POLICY": "fastest", "KVGATE_PORT": "99999"})
    assert p.popen.wait(timeout=30) == 2
    out = p.tail()
    assert "invalid configuration" in out and "policy:" in out and "port:" in out


class CrashingWorker:
    """A worker that answers its health checks and dies of the first chat request it gets: a real TCP
    server that writes ``answer`` (a 500, or nothing) and then closes the connection and stops listening,
    as a vLLM whose engine died of a request does."""

    def __init__(self, answer: bytes) -> None:
        self.answer = answer
        self.requests = 0
        self.server: asyncio.Server | None = None

    async def start(self, port: int = 0) -> str:
        self.server = await asyncio.start_server(self._conn, "127.0.0.1", port)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                await reader.readexactly(length)
                if head.startswith(b"POST /v1/"):
                    self.requests += 1
                    writer.write(self.answer)
                    await writer.drain()
                    assert self.server is not None
                    self.server.close()  # the process is gone: nothing listens any more
                    break
                status = b"200 OK" if head.startswith(b"GET /health ") else b"404 Not Found"
                writer.write(b"HTTP/1.1 " + status + b"\r\ncontent-length: 0\r\n\r\n")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


BODY_500 = b'{"error": {"message": "EngineCore encountered an issue", "code": 500}}'
ANSWER_500 = (b"HTTP/1.1 500 Internal Server Error\r\ncontent-type: application/json\r\n"
              b"content-length: %d\r\nconnection: close\r\n\r\n" % len(BODY_500)) + BODY_500


@pytest.mark.parametrize(("answer", "status", "code"), [
    (ANSWER_500, 400, "upstream_request_failed"),
    (b"", 502, "upstream_connection_lost"),
])
async def test_a_request_that_crashes_a_worker_is_not_handed_to_the_next_one(answer: bytes, status: int,
                                                                             code: str) -> None:
    workers = [CrashingWorker(answer) for _ in range(3)]
    urls = [await w.start() for w in workers]
    settings = GatewaySettings(workers=[WorkerConfig(url=u, model=MODEL, engine="sim") for u in urls],
                               max_attempts=3, health_interval_s=30)
    gw = await start_server(create_app(settings))
    try:
        async with httpx.AsyncClient(timeout=10) as h:
            r = await h.post(gw.url + "/v1/chat/completions",
                             json={"model": MODEL, "messages": [{"role": "user", "content": "poison"}]})
        assert r.status_code == status and "retry-after" not in r.headers
        assert r.json()["error"]["code"] == code and "not retried" in r.json()["error"]["message"]
        assert sum(w.requests for w in workers) == 1
    finally:
        await gw.stop()
        for w in workers:
            assert w.server is not None
            w.server.close()


BODY_502 = b'{"error": {"message": "upstream connect error", "code": 502}}'
ANSWER_502 = (b"HTTP/1.1 502 Bad Gateway\r\ncontent-type: application/json\r\n"
              b"content-length: %d\r\nconnection: close\r\n\r\n" % len(BODY_502)) + BODY_502


async def test_workers_answering_502_are_tried_twice_not_every_one() -> None:
    # A proxy in front of each engine answers 502 when the request kills the engine: the first is retried on
    # one other worker (the worker may have been the cause), not on all of them.
    workers = [CrashingWorker(ANSWER_502) for _ in range(5)]
    urls = [await w.start() for w in workers]
    settings = GatewaySettings(workers=[WorkerConfig(url=u, model=MODEL, engine="sim") for u in urls],
                               max_attempts=5, health_interval_s=30)
    gw = await start_server(create_app(settings))
    try:
        async with httpx.AsyncClient(timeout=10) as h:
            r = await h.post(gw.url + "/v1/chat/completions",
                             json={"model": MODEL, "messages": [{"role": "user", "content": "poison"}]})
            text = (await h.get(gw.url + "/metrics")).text
        assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
        assert r.json()["error"]["code"] == "upstream_failed"
        assert sum(w.requests for w in workers) == 2
        assert "kvgate_retries_total 1.0" in text
    finally:
        await gw.stop()
        for w in workers:
            assert w.server is not None
            w.server.close()


async def test_refused_connections_still_use_every_attempt(model_dir: Path) -> None:
    # Workers that never got the request (they stopped listening after their last health check) do not
    # count against the two: the request is safe to send on, up to max_attempts.
    # Round robin starts at the first worker in id order ("127.0.0.1:PORT", compared as text): the gone
    # ones get the three first ports so the request meets all of them before the live one.
    ports = sorted((free_port() for _ in range(4)), key=lambda p: f"127.0.0.1:{p}")
    gone = [CrashingWorker(b"") for _ in range(3)]
    urls = [await w.start(port) for w, port in zip(gone, ports, strict=False)]
    sim = SimWorker(SimSettings(model_dir=str(model_dir), hash_seed="0"))
    live = await start_server(sim.build_app(), port=ports[3])
    settings = GatewaySettings(workers=[WorkerConfig(url=u, model=MODEL, engine="sim") for u in [*urls, live.url]],
                               max_attempts=4, health_interval_s=30, policy="round_robin")
    gw = await start_server(create_app(settings))
    try:
        for w in gone:
            assert w.server is not None
            w.server.close()
            await w.server.wait_closed()
        async with httpx.AsyncClient(timeout=10) as h:
            r = await h.post(gw.url + "/v1/chat/completions", json={
                "model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
            text = (await h.get(gw.url + "/metrics")).text
        assert r.status_code == 200, r.text
        assert "kvgate_retries_total 3.0" in text
        assert sum(w.requests for w in gone) == 0
    finally:
        await gw.stop()
        await live.stop()
