"""HTTP/1.1 connections a slow or hostile client cannot hold (issue 24, docs/hostile-input.md).

uvicorn's httptools protocol with what it lacks (read in uvicorn 0.55's ``httptools_impl.py``):

- no deadline for a request's headers: its keep-alive timer is armed only after a response and any byte
  cancels it, so a connection that never sends, or sends a byte every few seconds, is held for ever;
- no limit on headers: httptools gathers each header value whole (32 MiB read, then answered 200);
- no cap short of the open-file limit, where ``accept()`` fails (EMFILE) and asyncio retries a second
  later, so /health goes unanswered; ``limit_concurrency`` answers 503 to every request, probes too.

uvicorn's h11 protocol has a limit (``h11_max_incomplete_event_size``) but answers it 400, has no header
deadline either, and parses in Python; hence a subclass of the httptools one rather than a setting.
"""

from __future__ import annotations

import asyncio
import json
import resource
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol
from uvicorn.server import ServerState

from kvgate.errors import error_body
from kvgate.settings.limits import ConnectionLimits

PROBE_PATHS = frozenset({b"/health", b"/ready"})
"""Served on a connection over the cap: an orchestrator's probes must tell "busy" from "dead"."""

LINGER_S = 1.0
LINGER_BYTES = 1 << 20
"""After a refusal the connection is read and dropped for this long (or this much) before it is closed:
closed at once with the client's bytes unread, the kernel answers RST and the client may never see the
refusal (nginx's lingering close)."""


LISTEN_QUEUE = 2048
"""The kernel's queue of connections not yet accepted (uvicorn's default backlog)."""


def open_file_limit() -> int:
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return 1 << 20 if soft == resource.RLIM_INFINITY else soft


@dataclass(frozen=True)
class ConnectionPolicy:
    header_timeout_s: float
    keep_alive_timeout_s: float
    max_header_bytes: int
    cap: int
    """Client connections kept; over it the idlest is closed, or a new one is served probes only."""
    ceiling: int
    """Open connections beyond which a new one is closed at once: what keeps the last descriptors free."""
    accept_batch: int
    """Connections asyncio accepts in one go (its ``backlog`` argument) before any is handed to its protocol,
    so before any can be shed: 2,048 of them (uvicorn's default) run a 1,024-descriptor process out at
    once, and asyncio then stops accepting for a second after each EMFILE."""

    @classmethod
    def from_limits(cls, limits: ConnectionLimits, nofile: int | None = None) -> ConnectionPolicy:
        nofile = open_file_limit() if nofile is None else nofile
        reserve = limits.fd_reserve if limits.fd_reserve is not None else max(64, nofile // 4)
        by_fds = max(1, nofile - reserve)
        cap = min(limits.max_connections or by_fds, by_fds)
        return cls(limits.header_timeout_s, limits.keep_alive_timeout_s, limits.max_header_bytes, cap,
                   cap + max(1, reserve // 2), max(8, min(LISTEN_QUEUE, reserve // 4)))


@dataclass(frozen=True)
class Shedding:
    """New inference requests refused at the connection while kvgate's loop runs late (``active``,
    gateway/looplag.py), before the app sees them. Refused by the app, each still cost the loop its
    middleware, routing and request objects: at 3x the sustainable rate the refusals themselves kept the
    loop late, so the requests admitted waited seconds (kvgate bench overhead --loadgen aiperf). Here a
    refusal costs the parse of its headers (in C) and one write; the connection stays open (its body, if
    any, is dropped as it arrives)."""

    active: Callable[[], bool]
    """Whether to shed now (it counts what it sheds)."""
    answers: Mapping[bytes, bytes]
    """Path -> the refusal's JSON body in that door's own error shape (POST only)."""
    retry_after_s: int


def refusal(body: bytes, retry_after_s: int) -> ASGIApp:
    """A constant 503 with Retry-After, keep-alive (the app a shed request is handed to)."""
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               (b"retry-after", str(retry_after_s).encode())]

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 503, "headers": headers})
        await send({"type": "http.response.body", "body": body})
    return app


class GuardedConfig(uvicorn.Config):
    """uvicorn's settings plus the connection policy (and the shedding, if any), which the protocol reads
    from its config."""

    def __init__(self, app: Any, policy: ConnectionPolicy, shedding: Shedding | None = None, **kwargs: Any) -> None:
        super().__init__(app, http=GuardedProtocol, backlog=policy.accept_batch, **kwargs)
        self.policy = policy
        self.shedding = shedding
        self.refusals = {} if shedding is None else \
            {path: refusal(body, shedding.retry_after_s) for path, body in shedding.answers.items()}


async def overloaded(scope: Scope, receive: Receive, send: Send) -> None:
    """The answer to a request on a connection over the cap (not a probe): 503, and the connection closed."""
    body = json.dumps(error_body("The gateway has too many open connections; retry shortly.",
                                 "service_unavailable", None, "too_many_connections")).encode()
    await send({"type": "http.response.start", "status": 503,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"retry-after", b"1"), (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


class GuardedProtocol(HttpToolsProtocol):
    def __init__(self, config: uvicorn.Config, server_state: ServerState, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None) -> None:
        super().__init__(config, server_state, app_state, _loop)
        if not isinstance(config, GuardedConfig):
            raise TypeError("GuardedProtocol needs a GuardedConfig")
        self.policy = config.policy
        self._shedding = config.shedding
        self._refusals = config.refusals
        self.timeout_keep_alive = self.policy.keep_alive_timeout_s  # type: ignore[assignment]  # uvicorn: int
        self._app = self.app
        self._in_headers = True
        """The bytes arriving are a request line or headers (not a body)."""
        self._header_bytes = 0
        self._header_timer: asyncio.TimerHandle | None = None
        self._idle_since = self.loop.time()
        self._over_cap = False
        self._lingering = -1
        """Bytes still to drop after a refusal; -1: none was sent."""

    # -- connections ---------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        # uvicorn arms this only after a first response: a connection that never sends would stay open.
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self.timeout_keep_alive_handler)
        if len(self.connections) > self.policy.cap:
            self._make_room()

    def _make_room(self) -> None:
        live, victim, victim_key = 0, None, (2, 0.0)
        for c in self.connections:
            if not isinstance(c, GuardedProtocol) or c.transport.is_closing():
                continue
            live += 1
            key = c._shed_key()
            if c is not self and key is not None and key < victim_key:
                victim, victim_key = c, key
        if live <= self.policy.cap:
            return  # the excess is already closing
        if victim is not None:
            victim.transport.close()
        elif len(self.connections) > self.policy.ceiling:
            self.transport.close()
        else:
            self._over_cap = True

    def _shed_key(self) -> tuple[int, float] | None:
        """None while a request is being served; otherwise connections with nothing of a next request
        come before those part way through its headers, the longest idle first."""
        if not self._in_headers or (self.cycle is not None and not self.cycle.response_complete):
            return None
        return (1 if self._header_bytes else 0, self._idle_since)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    # -- bytes ---------------------------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        if self._lingering >= 0:
            self._lingering -= len(data)
            if self._lingering < 0:
                self.transport.close()
            return
        while data and self._in_headers:
            room = self.policy.max_header_bytes - self._header_bytes
            if room <= 0:
                self._refuse(431, f"Request headers exceed the limit of {self.policy.max_header_bytes} bytes.",
                             "request_header_fields_too_large")
                return
            head, data = data[:room], data[room:]
            self._header_bytes += len(head)
            super().data_received(head)
            if self.transport.is_closing() or self._lingering >= 0:
                return
        if data:
            super().data_received(data)

    # -- parser callbacks ----------------------------------------------------------------------------
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._cancel_header_timer()
        self._header_timer = self.loop.call_later(self.policy.header_timeout_s, self._headers_late)

    def on_headers_complete(self) -> None:
        self._in_headers = False
        self._cancel_header_timer()
        path = self.url.split(b"?", 1)[0]
        probe = path in PROBE_PATHS
        self.app = overloaded if self._over_cap and not probe else self._shed(path) or self._app
        super().on_headers_complete()

    def _shed(self, path: bytes) -> ASGIApp | None:
        refuse = self._refusals.get(path)
        if refuse is None or self._shedding is None or self.parser.get_method() != b"POST":
            return None
        return refuse if self._shedding.active() else None

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._in_headers = True
        self._header_bytes = 0

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._idle_since = self.loop.time()

    # -- refusals ------------------------------------------------------------------------------------
    def _headers_late(self) -> None:
        self._header_timer = None
        if not self._in_headers or self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.keep_alive = False  # a pipelined request: close once the current response is out
            return
        self._refuse(408, f"Request headers not received within {self.policy.header_timeout_s:g} s.",
                     "request_timeout")

    def _refuse(self, status: int, message: str, code: str) -> None:
        """Answer ``status`` in OpenAI's error shape without reading on, then close (after a linger)."""
        if self.cycle is not None and not self.cycle.response_complete:
            self.transport.close()  # a pipelined request's: an answer now would land inside the current one
            return
        self._cancel_header_timer()
        self._unset_keepalive_if_required()
        body = json.dumps(error_body(message, "invalid_request_error", None, code)).encode()
        head = [STATUS_LINE[status]]
        for name, value in self.server_state.default_headers:
            head += [name, b": ", value, b"\r\n"]
        head += [b"content-type: application/json\r\ncontent-length: ", str(len(body)).encode(),
                 b"\r\nconnection: close\r\n\r\n", body]
        self.transport.write(b"".join(head))
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self._lingering = LINGER_BYTES
        self.loop.call_later(LINGER_S, self.transport.close)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
