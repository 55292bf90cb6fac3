"""gateway/h1client.py against a real socket server that answers as each test needs."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import pytest

from kvgate.gateway.h1client import BUFFER_BYTES, H1Upstream
from kvgate.gateway.upstream import Lost, NotSent

Reply = Callable[[bytes, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[bool]]
"""Answers one request (its head); False ends the connection."""


@dataclass
class Server:
    port: int
    connections: int = 0
    requests: list[bytes] = field(default_factory=list)
    eofs: int = 0
    open_now: int = 0
    open_most: int = 0

    def url(self, path: str = "/v1/chat/completions") -> str:
        return f"http://127.0.0.1:{self.port}{path}"


async def _serve(reply: Reply) -> tuple[Server, asyncio.Server]:
    state = Server(0)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        state.connections += 1
        state.open_now += 1
        state.open_most = max(state.open_most, state.open_now)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length")), 0)
                await reader.readexactly(length)
                state.requests.append(head)
                if not await reply(head, reader, writer):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            state.eofs += 1
        finally:
            state.open_now -= 1
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0, family=socket.AF_INET)
    state.port = server.sockets[0].getsockname()[1]
    return state, server


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[Reply], Awaitable[Server]]]:
    servers: list[asyncio.Server] = []

    async def start(reply: Reply) -> Server:
        state, server = await _serve(reply)
        servers.append(server)
        return state

    yield start
    for s in servers:
        s.close()


async def _json(head: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\ncontent-length: 2\r\n\r\n{}")
    await writer.drain()
    return True


async def _sse(head: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
    for i in range(3):
        event = b"data: %d\n\n" % i
        writer.write(b"%x\r\n%s\r\n" % (len(event), event))
        await writer.drain()
        await asyncio.sleep(0.005)
    writer.write(b"0\r\n\r\n")
    await writer.drain()
    return True


async def _post(up: H1Upstream, url: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    resp = await up.post(url, b'{"a": 1}', headers or {"content-type": "application/json"})
    try:
        return resp.status, await resp.read()
    finally:
        await resp.close()


async def test_answers_are_read_whole_and_connections_reused(serve: Callable[[Reply], Awaitable[Server]]) -> None:
    s = await serve(_sse)
    up = H1Upstream(connect_timeout_s=1.0, read_timeout_s=5.0)
    try:
        for _ in range(3):
            resp = await up.post(s.url(), b"{}", {"content-type": "application/json"})
            assert resp.status == 200 and resp.header("Content-Type") == "text/event-stream"
            assert [c async for c in resp.chunks()] == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n"]
            await resp.close()
    finally:
        await up.aclose()
    assert s.connections == 1 and len(s.requests) == 3
    head = s.requests[0]
    assert head.startswith(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:")
    assert b"Content-Length: 2\r\n" in head and b"content-type: application/json\r\n" in head


async def test_a_header_that_would_end_its_line_early_is_not_sent(serve: Callable[[Reply], Awaitable[Server]]) -> None:
    s = await serve(_json)
    up = H1Upstream(connect_timeout_s=1.0, read_timeout_s=5.0)
    try:
        assert await _post(up, s.url(), {"x-a": "1\r\nx-injected: yes", "x-b\n": "2", "host": "evil",
                                         "content-length": "1", "x-c": "ok"}) == (200, b"{}")
    finally:
        await up.aclose()
    (head,) = s.requests
    assert b"x-injected" not in head and b"x-b" not in head and b"evil" not in head
    assert b"x-c: ok\r\n" in head and head.count(b"Content-Length") == 1


async def test_a_request_on_a_connection_the_worker_just_closed_is_sent_again(
        serve: Callable[[Reply], Awaitable[Server]]) -> None:
    served: set[int] = set()

    async def once_per_connection(head: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        if id(writer) in served:
            return False  # the keep-alive timeout closing as the request arrives
        served.add(id(writer))
        return await _json(head, reader, writer)

    s = await serve(once_per_connection)
    up = H1Upstream(connect_timeout_s=1.0, read_timeout_s=5.0)
    try:
        for _ in range(3):
            assert await _post(up, s.url()) == (200, b"{}")
    finally:
        await up.aclose()
    assert s.connections == 3


async def test_a_new_connection_closed_before_an_answer_is_lost_and_not_sent_again(
        serve: Callable[[Reply], Awaitable[Server]]) -> None:
    async def hang_up(head: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        return False

    s = await serve(hang_up)
    up = H1Upstream(connect_timeout_s=1.0, read_timeout_s=5.0)
    try:
        with pytest.raises(Lost) as err:
            await _post(up, s.url())
    finally:
        await up.aclose()
    assert err.value.kind == "RemoteProtocolError" and not err.value.timeout
    assert len(s.requests) == 1


async def test_a_refused_connection_is_not_sent() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, not listening: refused
        up = H1Upstream(connect_timeout_s=1.0, read_timeout_s=5.0)
        with pytest.raises(NotSent) as err:
            await up.post(f"http://127.0.0.1:{port}/v1/completions", b"{}", {})
    assert err.value.kind == "ConnectError"


async def test_a_connection_not_accepted_in_time_is_not_sent() -> None:
    # A listener whose backlog is full: the kernel drops the SYN and the connect waits.
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers = []
    try:
        for _ in range(4):
            f = socket.socket()
            f.setblocking(False)
            f.connect_ex(("127.0.0.1", port))
            fillers.append(f)
        await asyncio.sleep(0.05)
        up = H1Upstream(connect_timeout_s=0.3, read_timeout_s=5.0)
        with pytest.raises(NotSent) as err:
            await up.post(f"http://127.0.0.1:{port}/v1/completions", b"{}", {})
        assert err.value.kind == "ConnectTimeout"
    finally:
        for f in fillers:
            f.close()
        listener.close()


async def test_no_answer_within_the_read_timeout_is_a_lost_timeout(serve: Callable[[Reply], Awaitable[Server]]) -> None:
    async def silent(head: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        await asyncio.sleep(5)
        return False

    s = await serve(silent)
    up = H1Upstream(connect_timeout_s=1.0, read_timeout_s=0.2)
    try:
        with pytest.raises(Lost) as err:
            await up.post(s.url(), b"{}", {})
    finally:
        await up.aclose()
    assert err.value.kind == "ReadTimeout" and err.value.timeout


async def test_the_read_timeout_is_between_reads_not_for_the_whole_answer(
        serve: Callable[[Reply], Awaitable[Server]]) -> None:
    async def slow_then_stalled(head: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for _ in range(6):  # 0.6 s of answer, a read every 0.1 s
            writer.write(b"2\r\nok\r\n")
            await writer.drain()
            await asyncio.sleep(0.1)
        await asyncio.sleep(5)
        return False

    s = await serve(slow_then_stalled)
    up = H1Upstream(connect_timeout_s=1.0, read_timeout_s=0.3)
    got: list[bytes] = []
    try:
        resp = await up.post(s.url(), b"{}", {})
        with pytest.raises(Lost) as err:
            async for chunk in resp.chunks():
                got.append(chunk)
        await resp.close()
    finally:
        await up.aclose()
    assert b"".join(got) == b"ok" * 6 and err.value.kind == "ReadTimeout"


@pytest.mark.parametrize("answer, kind", [
    (b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc", "RemoteProtocolError"),  # closed before its length
    (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n", "RemoteProtocolError"),  # not a chunk size
])
async def test_a_broken_answer_is_lost(serve: Callable[[Reply], Awaitable[Server]], answer: bytes, kind: str) -> None:
    async def broken(head: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(answer)
        await writer.drain()
        return False

    s = await serve(broken)
    up = H1Upstream(connect_timeout_s=1.0, read_timeout_s=5.0)
    try:
        resp = await up.post(s.url(), b"{}", {})
        with pytest.raises(Lost) as err:
            await resp.read()
        await resp.close()
    finally:
        await up.aclose()
    assert err.value.kind == kind


async def test_garbage_for_a_status_line_is_lost(serve: Callable[[Reply], Awaitable[Server]]) -> None:
    async def garbage(head: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"SSH-2.0-OpenSSH\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(1)
        return False

    s = await serve(garbage)
    up = H1Upstream(connect_timeout_s=1.0, read_timeout_s=5.0)
    try:
        with pytest.raises(Lost) as err:
            await up.post(s.url(), b"{}", {})
    finally:
        await up.aclose()
    assert err.value.kind == "RemoteProtocolError"


async def test_an_answer_until_the_connection_closes_ends_there(serve: Callable[[Reply], Awaitable[Server]]) -> None:
    async def until_close(head: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nall of it")
        await writer.drain()
        return False

    s = await serve(until_close)
    up = H1Upstream(connect_timeout_s=1.0, read_timeout_s=5.0)
    try:
        assert await _post(up, s.url()) == (200, b"all of it")
        assert await _post(up, s.url()) == (200, b"all of it")
    finally:
        await up.aclose()
    assert s.connections == 2


async def test_closing_before_the_end_closes_the_connection(serve: Callable[[Reply], Awaitable[Server]]) -> None:
    async def endless(head: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        while True:
            writer.write(b"4\r\ntick\r\n")
            await writer.drain()
            await asyncio.sleep(0.01)

    s = await serve(endless)
    up = H1Upstream(connect_timeout_s=1.0, read_timeout_s=5.0)
    try:
        resp = await up.post(s.url(), b"{}", {})
        await anext(resp.chunks())
        await resp.close()
        for _ in range(100):
            if s.eofs:
                break
            await asyncio.sleep(0.01)
        assert s.eofs == 1  # the worker sees the client go, and stops
        resp = await up.post(s.url(), b"{}", {})
        await resp.close()
    finally:
        await up.aclose()
    assert s.connections == 2


async def test_a_relay_that_does_not_read_pauses_the_worker(serve: Callable[[Reply], Awaitable[Server]]) -> None:
    total = 256 * BUFFER_BYTES  # 64 MB: more than the kernel's socket buffers hold
    sent = [0]

    async def flood(head: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % total)
        piece = b"x" * 65536
        while sent[0] < total:
            writer.write(piece)
            await writer.drain()
            sent[0] += len(piece)
        return True

    s = await serve(flood)
    up = H1Upstream(connect_timeout_s=1.0, read_timeout_s=5.0)
    try:
        resp = await up.post(s.url(), b"{}", {})
        await asyncio.sleep(0.3)
        assert sent[0] < total  # the worker was held back: nothing read it
        held = resp._buffered  # type: ignore[attr-defined]
        assert BUFFER_BYTES < held <= 2 * BUFFER_BYTES  # paused once past the bound, after one more read
        got = sum([len(c) async for c in resp.chunks()])
        await resp.close()
    finally:
        await up.aclose()
    assert got == total


async def test_a_connection_paused_as_its_answer_ended_reads_the_next_one(
        serve: Callable[[Reply], Awaitable[Server]]) -> None:
    body = b"y" * (BUFFER_BYTES + 4096)
    first = [True]

    async def head_then_json(head: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        if first[0]:  # the body comes from the test, in one read (the socket would deliver it in several)
            first[0] = False
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(body))
        else:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}")
        await writer.drain()
        return True

    s = await serve(head_then_json)
    up = H1Upstream(connect_timeout_s=1.0, read_timeout_s=1.0)
    try:
        resp = await up.post(s.url(), b"{}", {})
        conn = resp._conn  # type: ignore[attr-defined]
        conn.data_received(body)  # past the bound in the read that also ends the answer: paused, then released
        # The next request takes the connection before the relay has read the first answer.
        assert await asyncio.wait_for(_post(up, s.url()), 5.0) == (200, b"{}")  # hung: released still paused
        assert await resp.read() == body
        await resp.close()
    finally:
        await up.aclose()
    assert s.connections == 1


async def test_an_idle_connection_past_the_keepalive_is_not_reused(serve: Callable[[Reply], Awaitable[Server]]) -> None:
    s = await serve(_json)
    up = H1Upstream(connect_timeout_s=1.0, read_timeout_s=5.0, keepalive_s=0.1)
    try:
        assert await _post(up, s.url()) == (200, b"{}")
        await asyncio.sleep(0.2)
        assert await _post(up, s.url()) == (200, b"{}")
        assert await _post(up, s.url()) == (200, b"{}")
    finally:
        await up.aclose()
    assert s.connections == 2


async def test_requests_over_the_limit_wait_for_a_slot(serve: Callable[[Reply], Awaitable[Server]]) -> None:
    async def slow(head: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        await asyncio.sleep(0.05)
        return await _json(head, reader, writer)

    s = await serve(slow)
    up = H1Upstream(connect_timeout_s=1.0, read_timeout_s=5.0, max_connections=2)
    try:
        answers = await asyncio.gather(*[_post(up, s.url()) for _ in range(6)])
    finally:
        await up.aclose()
    assert answers == [(200, b"{}")] * 6 and s.open_most == 2


async def test_a_cancelled_request_gives_its_slot_and_connection_back(
        serve: Callable[[Reply], Awaitable[Server]]) -> None:
    async def silent(head: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        if not await reader.read(1):
            raise ConnectionError("the client went")  # counted as its EOF
        return False

    s = await serve(silent)
    up = H1Upstream(connect_timeout_s=1.0, read_timeout_s=5.0, max_connections=1)
    try:
        task = asyncio.ensure_future(up.post(s.url(), b"{}", {}))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(100):
            if s.eofs:
                break
            await asyncio.sleep(0.01)
        assert s.eofs == 1
        again = asyncio.ensure_future(up.post(s.url(), b"{}", {}))
        await asyncio.sleep(0.1)
        assert len(s.requests) == 2  # the one slot is free again
        again.cancel()
    finally:
        await up.aclose()
