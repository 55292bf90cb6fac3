"""The proxied request's HTTP/1.1 client on asyncio's transports and httptools' parser.

Under streamed agent traffic aiohttp was 18% of kvgate's busy samples (docs/routing.md): its request
builder, its multidict headers, its stream reader and its per-chunk timers, most of which a proxy that sends
one POST and relays its bytes does not need. This client does only that: one request line and its headers
written with the body in one send, the answer parsed by httptools (the C parser uvicorn serves with), its
body handed on as it arrives, and connections kept per worker for reuse.

What it keeps of aiohttp's behaviour, because the sender relies on it (gateway/upstream.py's interface):
- the keep-alive race: a request sent on a reused connection that the worker closed before answering
  anything is sent once more, on a new connection (the engine aborts a request whose connection is gone);
- a connect timeout, and a read timeout that is the longest wait between two reads of the answer;
- bounded buffering: reading from the worker pauses while more than ``BUFFER_BYTES`` wait for the relay;
- at most ``max_connections`` requests in flight, the rest wait for a slot;
- ``close()`` before the answer's end closes the connection, so the worker sees it and aborts.

Failures are gateway/upstream.py's ``NotSent`` and ``Lost``, named with httpx's words as before.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

import httptools

from kvgate.gateway.upstream import Lost, NotSent, UpstreamResponse

BUFFER_BYTES = 256 * 1024
"""Answer bytes held for a relay that has not read them; over it, reading from the worker pauses."""

_OWN_HEADERS = frozenset({"host", "content-length", "transfer-encoding", "connection"})
_TARGETS_KEPT = 4096


@dataclass(frozen=True, slots=True)
class _Target:
    key: tuple[str, str, int]
    """(scheme, host, port): connections are pooled per target."""
    host: str
    port: int
    tls: bool
    start: bytes
    """``POST <path> HTTP/1.1`` and the Host header."""


def _target(url: str) -> _Target:
    u = urlsplit(url)
    if u.scheme not in ("http", "https") or not u.hostname:
        raise ValueError(f"not an http(s) URL: {url!r}")
    tls = u.scheme == "https"
    port = u.port or (443 if tls else 80)
    path = (u.path or "/") + (f"?{u.query}" if u.query else "")
    host = u.netloc.rpartition("@")[2]
    return _Target((u.scheme, u.hostname, port), u.hostname, port, tls,
                   f"POST {path} HTTP/1.1\r\nHost: {host}\r\n".encode())


def _head(target: _Target, body: bytes, headers: Mapping[str, str]) -> bytes:
    lines = [target.start]
    for name, value in headers.items():
        # A name or value that would end its line early would let it write headers of its own.
        if name.lower() in _OWN_HEADERS or any(c in name or c in value for c in "\r\n\0"):
            continue
        lines.append(f"{name}: {value}\r\n".encode())
    lines.append(b"Content-Length: %d\r\n\r\n" % len(body))
    return b"".join(lines)


class _Answer:
    """One request's answer, fed by its connection's parser callbacks."""

    def __init__(self, conn: _Connection, slots: asyncio.Semaphore) -> None:
        self._conn = conn
        self._slots = slots
        self.status = 0
        self._headers: list[tuple[bytes, bytes]] = []
        self._buf: list[bytes] = []
        self._buffered = 0
        self._waiter: asyncio.Future[None] | None = None
        self.heard = False
        """Any byte of the answer arrived (after it, a broken connection is not the keep-alive race)."""
        self.headers_done = False
        self.complete = False
        self.error: Lost | None = None
        self._slot = True  # holds one of the upstream's in-flight slots until it ends

    def header(self, name: str) -> str | None:
        want = name.lower().encode()
        for k, v in self._headers:
            if k.lower() == want:
                return v.decode("latin-1")
        return None

    async def chunks(self) -> AsyncIterator[bytes]:
        while True:
            if self._buf:
                yield self._take()
            elif self.error is not None:
                raise self.error
            elif self.complete:
                return
            else:
                await self._wait()

    async def read(self) -> bytes:
        parts = [chunk async for chunk in self.chunks()]
        return b"".join(parts)

    async def close(self) -> None:
        if not self.complete:
            self._conn.abort()
        self._end()

    def _take(self) -> bytes:
        data = self._buf[0] if len(self._buf) == 1 else b"".join(self._buf)
        self._buf.clear()
        if self._buffered > BUFFER_BYTES and not self.complete:  # once complete, the connection is another's
            self._conn.resume()
        self._buffered = 0
        return data

    async def _wait(self) -> None:
        self._waiter = self._conn.loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _end(self) -> None:
        if self._slot:
            self._slot = False
            self._slots.release()

    # The connection's parser callbacks.
    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name, value))

    def on_headers_complete(self, status: int) -> None:
        self.status = status
        self.headers_done = True
        self._wake()

    def on_body(self, data: bytes) -> None:
        self._buf.append(data)
        self._buffered += len(data)
        if self._buffered > BUFFER_BYTES:
            self._conn.pause()
        self._wake()

    def on_complete(self) -> None:
        self.complete = True
        self._wake()

    def fail(self, error: Lost) -> None:
        if not self.complete and self.error is None:
            self.error = error
        self._wake()

    def eof(self) -> None:
        """The connection ended: the answer's end if its length was "until the connection closes"."""
        if self.headers_done and self.header("content-length") is None and self.header("transfer-encoding") is None:
            self.on_complete()


class _Connection(asyncio.Protocol):
    def __init__(self, upstream: H1Upstream, target: _Target) -> None:
        self.loop = asyncio.get_running_loop()
        self.upstream = upstream
        self.target = target
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.answer: _Answer | None = None
        self.closed = False
        self.idle_since = 0.0
        self._paused = False
        self._last_read = 0.0
        self._timer: asyncio.TimerHandle | None = None

    def send(self, answer: _Answer, data: bytes) -> None:
        assert self.transport is not None and self.answer is None
        self.answer = answer
        self._last_read = self.loop.time()
        self._arm(self._last_read + self.upstream.read_timeout_s)
        self.transport.write(data)

    def abort(self) -> None:
        """The answer is not wanted whole: the connection goes (the worker sees it and stops)."""
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    def pause(self) -> None:
        if not self._paused and self.transport is not None and not self.closed:
            self._paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self._paused and self.transport is not None and not self.closed:
            self._paused = False
            self.transport.resume_reading()

    # The read timeout: one timer per request, moved on only when it fires (a timer per read would cost more
    # than the read).
    def _arm(self, when: float) -> None:
        self._timer = self.loop.call_at(when, self._check_read)

    def _check_read(self) -> None:
        self._timer = None
        a = self.answer
        if a is None:
            return
        due = self._last_read + self.upstream.read_timeout_s
        if self._paused or a._buf or self.loop.time() < due:  # the relay is behind, or a read came since
            self._arm(max(due, self.loop.time() + 0.05))
            return
        a.fail(Lost(TimeoutError("no answer bytes within the read timeout"), "ReadTimeout"))
        self.abort()

    def _done(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.answer = None

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        a = self.answer
        if a is None:  # bytes on an idle connection: nothing can be trusted on it any more
            self.abort()
            return
        a.heard = True
        self._last_read = self.loop.time()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            a.fail(Lost(exc, "RemoteProtocolError"))
            self._done()
            self.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        a = self.answer
        if a is None:
            return
        self._done()
        a.eof()
        if not a.complete:
            kind = "ReadError" if exc is not None else "RemoteProtocolError"
            a.fail(Lost(exc or ConnectionError("the worker closed the connection"), kind))

    # httptools' callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        if self.answer is not None:
            self.answer.on_header(name, value)

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if self.answer is None or 100 <= status < 200:
            raise httptools.HttpParserError(f"unexpected status {status}")
        self.answer.on_headers_complete(status)

    def on_body(self, body: bytes) -> None:
        if self.answer is not None:
            self.answer.on_body(body)

    def on_message_complete(self) -> None:
        a = self.answer
        if a is None:
            return
        keep = self.parser.should_keep_alive()
        self._done()
        a.on_complete()
        if keep and not self.closed:
            self.resume()  # what the relay has not read is the answer's now, not the connection's
            self.upstream._release(self)
        else:
            self.abort()


class H1Upstream:
    def __init__(self, connect_timeout_s: float, read_timeout_s: float, max_connections: int = 2000,
                 keepalive_s: float = 4.0) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self._keepalive_s = keepalive_s
        self._slots = asyncio.Semaphore(max_connections)
        self._idle: dict[tuple[str, str, int], list[_Connection]] = {}
        self._targets: dict[str, _Target] = {}
        self._tls: ssl.SSLContext | None = None

    async def post(self, url: str, body: bytes, headers: Mapping[str, str]) -> UpstreamResponse:
        target = self._targets.get(url)
        if target is None:
            target = _target(url)
            if len(self._targets) >= _TARGETS_KEPT:
                self._targets.clear()
            self._targets[url] = target
        data = _head(target, body, headers) + body
        await self._slots.acquire()
        try:
            conn = self._pooled(target)
            if conn is not None:
                answer = await self._exchange(conn, data, reused=True)
                if answer is not None:
                    return answer
                # The keep-alive race: the worker closed the pooled connection as the request went out on it,
                # before answering anything. Nothing ran, so it goes once more on a new connection, to the
                # same worker. If that worker is not there any more, the request may be what ended it: lost,
                # not for the next worker.
                try:
                    conn = await self._connect(target)
                except NotSent as gone:
                    raise Lost(gone, "RemoteProtocolError") from gone
            else:
                conn = await self._connect(target)
            answer = await self._exchange(conn, data, reused=False)
            assert answer is not None
            return answer
        except BaseException:
            self._slots.release()
            raise

    async def _exchange(self, conn: _Connection, data: bytes, reused: bool) -> _Answer | None:
        """The answer with its status and headers; None when a reused connection broke before any byte."""
        answer = _Answer(conn, self._slots)
        conn.send(answer, data)
        try:
            while not answer.headers_done and answer.error is None:
                await answer._wait()
        except BaseException:  # cancelled: the request is not wanted, so neither is its connection
            conn.abort()
            raise
        if answer.headers_done:
            return answer
        assert answer.error is not None
        if reused and not answer.heard and answer.error.kind != "ReadTimeout":
            return None
        raise answer.error

    def _pooled(self, target: _Target) -> _Connection | None:
        idle = self._idle.get(target.key)
        if not idle:
            return None
        now = asyncio.get_running_loop().time()
        while idle:
            conn = idle.pop()  # the most recently used: the others expire unused
            if not conn.closed and now - conn.idle_since < self._keepalive_s:
                return conn
            conn.abort()
        return None

    def _release(self, conn: _Connection) -> None:
        now = conn.loop.time()
        conn.idle_since = now
        idle = self._idle.setdefault(conn.target.key, [])
        # The list runs from the longest idle to the latest; those past the keep-alive leave from its front.
        drop = 0
        while drop < len(idle) and (idle[drop].closed or now - idle[drop].idle_since >= self._keepalive_s):
            idle[drop].abort()
            drop += 1
        if drop:
            del idle[:drop]
        idle.append(conn)

    async def _connect(self, target: _Target) -> _Connection:
        loop = asyncio.get_running_loop()
        tls = None
        if target.tls:
            if self._tls is None:
                self._tls = ssl.create_default_context()
            tls = self._tls
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await loop.create_connection(lambda: _Connection(self, target), target.host, target.port,
                                                       ssl=tls, server_hostname=target.host if tls else None)
        except TimeoutError as exc:
            raise NotSent(exc, "ConnectTimeout") from exc
        except OSError as exc:
            raise NotSent(exc, "ConnectError") from exc
        return conn

    async def aclose(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                conn.abort()
        self._idle.clear()
