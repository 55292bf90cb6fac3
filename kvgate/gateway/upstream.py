"""The proxied request's HTTP client, behind a small interface.

A proxied turn is a POST of a large body followed by a stream of small SSE chunks, and the client that
carries it was much of the gateway's CPU per request. Three carry it (``upstream_client``):
``gateway/h1client.py``, kvgate's own on httptools' parser, the default; aiohttp, which carried it before;
httpx, which carried it first. ``kvgate bench upstream`` measures them alone on one core (40 KB chat body,
streamed answers; docs/routing.md): per request of 17 events 0.19 / 0.39 / 1.68 ms of CPU. httpx stays
for everything else (health, events, probes, background prefills), where a few requests a second do not
matter.

What the sender needs to know of a failure is only whether the worker can have had the request:
``NotSent`` (refused or timed-out connection: another worker may take it) or ``Lost`` (it may have
started on it: not handed to the next one).
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Mapping
from typing import Literal, Protocol

import aiohttp
import httpx


class UpstreamError(Exception):
    def __init__(self, cause: BaseException, kind: str | None = None) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}" if str(cause) else type(cause).__name__)
        # One vocabulary whichever client carried the request (httpx's names, which the metrics' ``kind``
        # label and the alert rules have always used): ConnectError, ConnectTimeout, ReadTimeout, ...
        self.kind = kind or type(cause).__name__


class NotSent(UpstreamError):
    """The worker never had the whole request."""


class Lost(UpstreamError):
    """The worker had the request (or part of it) and the exchange broke."""

    def __init__(self, cause: BaseException, kind: str | None = None) -> None:
        super().__init__(cause, kind)
        self.timeout = self.kind.endswith("Timeout")


class UpstreamResponse(Protocol):
    status: int

    def header(self, name: str) -> str | None: ...

    def chunks(self) -> AsyncIterator[bytes]: ...

    async def read(self) -> bytes: ...

    async def close(self) -> None: ...


class Upstream(Protocol):
    async def post(self, url: str, body: bytes, headers: Mapping[str, str]) -> UpstreamResponse: ...

    async def aclose(self) -> None: ...


class AiohttpUpstream:
    def __init__(self, connect_timeout_s: float, read_timeout_s: float, max_connections: int = 2000,
                 keepalive_s: float = 4.0) -> None:
        self._timeout = aiohttp.ClientTimeout(total=None, connect=connect_timeout_s, sock_read=read_timeout_s)
        self._max_connections = max_connections
        self._keepalive_s = keepalive_s
        self._session: aiohttp.ClientSession | None = None  # made on the event loop, at first use

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None:
            # aiohttp sets TCP_NODELAY itself (see make_client for why that matters).
            connector = aiohttp.TCPConnector(limit=self._max_connections, limit_per_host=0,
                                             family=socket.AF_UNSPEC, keepalive_timeout=self._keepalive_s)
            self._session = aiohttp.ClientSession(connector=connector, timeout=self._timeout,
                                                  skip_auto_headers=("User-Agent",))
        return self._session

    async def post(self, url: str, body: bytes, headers: Mapping[str, str]) -> UpstreamResponse:
        try:
            try:
                resp = await self._open().post(url, data=body, headers=dict(headers))
            except _IDLE_CLOSED as exc:
                if isinstance(exc, aiohttp.ClientConnectorError):
                    raise
                # The keep-alive race: the worker closed the pooled connection as the request went out on
                # it, before answering anything. Nothing ran (the engine aborts a request whose connection
                # is gone), so it is sent once more, on a new connection, to the same worker. If that worker
                # is not there any more, the request may be what ended it: lost, not for the next worker.
                try:
                    resp = await self._open().post(url, data=body, headers=dict(headers))
                except aiohttp.ClientConnectorError as gone:
                    raise _aiohttp_lost(exc) from gone
        except aiohttp.ClientConnectorError as exc:
            raise NotSent(exc, "ConnectError") from exc
        except aiohttp.ConnectionTimeoutError as exc:
            raise NotSent(exc, "ConnectTimeout") from exc
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise _aiohttp_lost(exc) from exc
        return _AiohttpResponse(resp)

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()


_IDLE_CLOSED = (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)
"""What sending on a connection the peer has just closed raises (EOF before a status line; ECONNRESET or
EPIPE on the write). A ``ClientConnectorError`` — a new connection refused — is a ``ClientOSError`` too,
but it is raised before the request went anywhere and is not retried here."""


def _aiohttp_lost(exc: BaseException) -> Lost:
    if isinstance(exc, TimeoutError):
        return Lost(exc, "ReadTimeout")
    if isinstance(exc, (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError)):
        return Lost(exc, "RemoteProtocolError")
    return Lost(exc, "ReadError")


class _AiohttpResponse:
    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self._resp = resp
        self.status = resp.status

    def header(self, name: str) -> str | None:
        return self._resp.headers.get(name)

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._resp.content.iter_any():
                yield chunk
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise _aiohttp_lost(exc) from exc

    async def read(self) -> bytes:
        try:
            return await self._resp.read()
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise _aiohttp_lost(exc) from exc

    async def close(self) -> None:
        self._resp.close()  # closes the connection if the body was not read whole: the worker aborts


_HTTPX_NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout, httpx.WriteError,
                   httpx.WriteTimeout)


def _httpx_lost(exc: httpx.HTTPError) -> Lost:
    return Lost(exc)


class HttpxUpstream:
    def __init__(self, client: httpx.AsyncClient) -> None:
        self._client = client

    async def post(self, url: str, body: bytes, headers: Mapping[str, str]) -> UpstreamResponse:
        try:
            resp = await self._client.send(self._client.build_request("POST", url, content=body,
                                                                      headers=dict(headers)), stream=True)
        except _HTTPX_NOT_SENT as exc:
            raise NotSent(exc) from exc
        except httpx.HTTPError as exc:
            raise _httpx_lost(exc) from exc
        return _HttpxResponse(resp)

    async def aclose(self) -> None:
        pass  # the client is the gateway's, closed with it


class _HttpxResponse:
    def __init__(self, resp: httpx.Response) -> None:
        self._resp = resp
        self.status = resp.status_code

    def header(self, name: str) -> str | None:
        value: str | None = self._resp.headers.get(name)
        return value

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._resp.aiter_raw():
                yield chunk
        except httpx.HTTPError as exc:
            raise _httpx_lost(exc) from exc

    async def read(self) -> bytes:
        try:
            return await self._resp.aread()
        except httpx.HTTPError as exc:
            raise _httpx_lost(exc) from exc

    async def close(self) -> None:
        await self._resp.aclose()


def make_upstream(kind: Literal["httptools", "aiohttp", "httpx"], client: httpx.AsyncClient,
                  connect_timeout_s: float, read_timeout_s: float, keepalive_s: float = 4.0) -> Upstream:
    if kind == "httpx":
        return HttpxUpstream(client)
    if kind == "aiohttp":
        return AiohttpUpstream(connect_timeout_s, read_timeout_s, keepalive_s=keepalive_s)
    from kvgate.gateway.h1client import H1Upstream  # it builds on this module's errors

    return H1Upstream(connect_timeout_s, read_timeout_s, keepalive_s=keepalive_s)
