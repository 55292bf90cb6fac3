"""Connections a slow or hostile client cannot hold (kvgate/connections.py, docs/hostile-input.md): header
deadline and size, idle connections closed, a cap that sheds idle ones and keeps the probes answering.

Real sockets on loopback. Every wait is bounded: on a server without these limits the tests fail by
timing out at a few seconds, not by hanging."""

from __future__ import annotations

import asyncio
import json
import resource
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator

import httpx
import pytest
from fastapi import FastAPI, Request

from kvgate.connections import ConnectionPolicy, Shedding
from kvgate.serving import ServerHandle, free_port, start_server
from kvgate.settings.limits import ConnectionLimits

LIMITS = ConnectionLimits(header_timeout_s=0.5, keep_alive_timeout_s=0.5, max_header_bytes=8192, max_connections=4)
WAIT_S = 5.0
"""Ten times the limits above: what a server without them fails by."""


def _app() -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ping")
    async def ping() -> dict[str, bool]:
        return {"ok": True}

    @app.post("/upload")
    async def upload(request: Request) -> dict[str, int]:
        return {"bytes": len(await request.body())}

    return app


@pytest.fixture
async def server() -> AsyncIterator[ServerHandle]:
    h = await start_server(_app(), limits=LIMITS)
    yield h
    await h.kill()


async def _connect(h: ServerHandle) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection(h.host, h.port)


async def _answer(reader: asyncio.StreamReader) -> bytes:
    """Everything the server sends until it closes the connection (or WAIT_S passes: a failure)."""
    return await asyncio.wait_for(reader.read(), WAIT_S)


async def _connections(h: ServerHandle, n: int) -> None:
    for _ in range(int(WAIT_S / 0.01)):
        if len(h.server.server_state.connections) == n:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{len(h.server.server_state.connections)} connections, expected {n}")


def _get(path: str, header_bytes: int = 0) -> bytes:
    head = f"GET {path} HTTP/1.1\r\nhost: t\r\n".encode()
    pad = b"x-pad: " + b"a" * max(0, header_bytes - len(head) - 11) + b"\r\n" if header_bytes else b""
    return head + pad + b"\r\n"


async def test_trickled_headers_get_408_and_the_connection_closed_at_the_header_deadline(server: ServerHandle) -> None:
    reader, writer = await _connect(server)
    writer.write(b"GET /ping HTTP/1.1\r\nhost: t\r\n")
    t0 = time.monotonic()

    async def trickle() -> None:
        for i in range(int(WAIT_S / 0.1)):  # a header line every 100 ms: each byte resets uvicorn's timer
            writer.write(f"x-{i}: y\r\n".encode())
            await asyncio.sleep(0.1)

    task = asyncio.create_task(trickle())
    try:
        answer = await _answer(reader)
    finally:
        task.cancel()
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"
    assert time.monotonic() - t0 < 3.0  # the deadline runs from the first byte, not the last
    writer.close()


async def test_a_silent_connection_is_closed_after_the_keep_alive_timeout(server: ServerHandle) -> None:
    reader, writer = await _connect(server)
    assert await _answer(reader) == b""
    writer.close()


async def test_oversized_headers_get_431_before_they_end(server: ServerHandle) -> None:
    reader, writer = await _connect(server)
    # Twice the limit and never ended: only a server that stops reading at the limit answers at all.
    writer.write(b"GET /ping HTTP/1.1\r\nhost: t\r\nx-big: " + b"a" * 16384)
    answer = await _answer(reader)
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
    body = json.loads(answer.split(b"\r\n\r\n", 1)[1])
    assert body["error"]["code"] == "request_header_fields_too_large"
    writer.close()


@pytest.mark.parametrize(("size", "status"), [(8192, b"200"), (8193, b"431")])
async def test_headers_of_exactly_the_limit_pass(server: ServerHandle, size: int, status: bytes) -> None:
    reader, writer = await _connect(server)
    request = _get("/ping", size)
    assert len(request) == size
    writer.write(request)
    line = await asyncio.wait_for(reader.readline(), WAIT_S)
    assert line.split()[1] == status, line
    writer.close()


async def test_a_body_in_the_same_write_as_its_headers_is_not_counted_as_headers(server: ServerHandle) -> None:
    reader, writer = await _connect(server)
    body = b"b" * 20000  # over the header limit, arriving in one piece with the headers
    writer.write(b"POST /upload HTTP/1.1\r\nhost: t\r\ncontent-length: 20000\r\n\r\n" + body)
    # Then two pipelined requests in one write: each is counted from its own start.
    writer.write(_get("/ping", 6000) + _get("/ping", 6000))
    got = b""
    while got.count(b"HTTP/1.1 200 ") < 3:
        chunk = await asyncio.wait_for(reader.read(65536), WAIT_S)
        assert chunk, got
        got += chunk
    assert b'{"bytes":20000}' in got and b"431" not in got
    writer.close()


async def test_over_the_cap_the_idlest_connection_is_shed_and_health_answers(server: ServerHandle) -> None:
    idle = [await _connect(server) for _ in range(LIMITS.max_connections or 0)]
    await _connections(server, len(idle))
    async with httpx.AsyncClient(base_url=server.url, timeout=WAIT_S) as c:
        assert (await c.get("/health")).status_code == 200
    # The first one opened was the idlest: it is the one closed to make room.
    assert await asyncio.wait_for(idle[0][0].read(), WAIT_S) == b""
    for _, w in idle:
        w.close()


async def test_over_the_cap_with_none_idle_only_the_probes_are_served(server: ServerHandle) -> None:
    busy = []
    for _ in range(LIMITS.max_connections or 0):  # requests under way: their bodies never come
        reader, writer = await _connect(server)
        writer.write(b"POST /upload HTTP/1.1\r\nhost: t\r\ncontent-length: 100\r\n\r\n")
        busy.append((reader, writer))
    await _connections(server, len(busy))
    await asyncio.sleep(0.05)  # the requests' headers are read
    async with httpx.AsyncClient(base_url=server.url, timeout=WAIT_S) as c:
        assert (await c.get("/health")).status_code == 200
        r = await c.get("/ping")
        assert r.status_code == 503 and r.headers["connection"] == "close" and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "too_many_connections"
    for reader, w in busy:  # none was shed, and each still completes
        w.write(b"x" * 100)
        assert b'{"bytes":100}' in await asyncio.wait_for(reader.read(4096), WAIT_S)
        w.close()


def test_the_cap_keeps_descriptors_in_reserve() -> None:
    p = ConnectionPolicy.from_limits(ConnectionLimits(), nofile=1024)
    assert (p.cap, p.ceiling, p.accept_batch) == (768, 896, 64)
    assert ConnectionPolicy.from_limits(ConnectionLimits(max_connections=5000), nofile=1024).cap == 768
    assert ConnectionPolicy.from_limits(ConnectionLimits(max_connections=10), nofile=1024).cap == 10


async def test_a_gateway_at_its_open_file_limit_still_answers_health() -> None:
    """The finding: idle connections past the open-file limit left ``accept`` failing (EMFILE) and
    /health unanswered. A real ``kvgate serve`` with a 256-descriptor limit and 300 idle connections."""
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvgate.cli", "serve", "--port", str(port),
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256)),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    socks: list[socket.socket] = []
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=1.0) as c:
            for _ in range(300):
                try:
                    assert (await c.get("/health")).status_code == 200
                    break
                except httpx.TransportError:
                    await asyncio.sleep(0.05)
            for _ in range(300):
                socks.append(socket.create_connection(("127.0.0.1", port)))
        await asyncio.sleep(0.5)  # accepted (and the oldest shed)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=WAIT_S) as c:
            # Within WAIT_S (the client's timeout); on a0afb21 never: no descriptor is ever freed.
            assert (await c.get("/health")).status_code == 200
    finally:
        for s in socks:
            s.close()
        proc.kill()
        await asyncio.wait_for(proc.wait(), 10)


async def test_a_shed_request_is_refused_before_the_app_and_its_connection_serves_the_next() -> None:
    """Shedding (kvgate/connections.Shedding): a POST to a shed path while ``active`` is answered 503 with
    Retry-After and the door's body, never reaching the app; other methods, paths and the probes do; the
    connection stays open, the refused request's body dropped, and the next request on it is served."""
    shed = {"on": True, "count": 0}
    calls: list[str] = []
    app = _app()

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> dict[str, int]:
        calls.append("chat")
        return {"bytes": len(await request.body())}

    def active() -> bool:
        shed["count"] += shed["on"]
        return bool(shed["on"])

    refusal = b'{"error":{"code":"overloaded"}}'
    h = await start_server(app, limits=LIMITS,
                           shedding=Shedding(active, {b"/v1/chat/completions": refusal}, retry_after_s=3))
    try:
        reader, writer = await _connect(h)
        body = b"x" * 100_000  # a large body behind the refused request's headers: dropped as it arrives
        writer.write(b"POST /v1/chat/completions?x=1 HTTP/1.1\r\nhost: t\r\ncontent-length: 100000\r\n\r\n" + body)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT_S)
        assert head.startswith(b"HTTP/1.1 503 ") and b"retry-after: 3\r\n" in head.lower(), head
        assert await asyncio.wait_for(reader.readexactly(len(refusal)), WAIT_S) == refusal
        writer.write(_get("/health"))
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT_S)
        assert head.startswith(b"HTTP/1.1 200 "), head  # a probe is never shed, on the same connection
        await asyncio.wait_for(reader.readexactly(15), WAIT_S)
        shed["on"] = False
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\ncontent-length: 2\r\n\r\n{}")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT_S)
        assert head.startswith(b"HTTP/1.1 200 "), head
        assert await asyncio.wait_for(reader.readexactly(11), WAIT_S) == b'{"bytes":2}'
        writer.close()
        assert calls == ["chat"] and shed["count"] == 1
        shed["on"] = True
        async with httpx.AsyncClient(base_url=h.url) as c:
            assert (await c.post("/upload", content=b"abc")).json() == {"bytes": 3}  # not a shed path
            assert (await c.get("/v1/chat/completions")).status_code == 405  # not a POST: the app's answer
        assert calls == ["chat"] and shed["count"] == 1
    finally:
        await h.kill()
