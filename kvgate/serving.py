"""Running ASGI apps under uvicorn inside an existing event loop (CLI, demo, tests, benchmarks).

Only uvicorn's public API: ``Server.serve(sockets=...)``, ``Server.capture_signals`` and
``Server.handle_exit`` (overridden), ``started``/``should_exit``/``force_exit``.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import socket
from collections.abc import Callable, Iterator
from types import FrameType

import uvicorn
from fastapi import FastAPI


class DrainingServer(uvicorn.Server):
    """On SIGTERM/SIGINT, first flip the app to draining (``/ready`` answers 503), then let uvicorn
    stop accepting and finish in-flight requests within its graceful-shutdown timeout.

    ``owns_signals=False``: several servers share one process in the demo and the tests, and only the
    main one may install handlers (each install replaces the previous one's, and uvicorn re-raises the
    captured signal once it is done, which would end the process under the other servers)."""

    def __init__(self, config: uvicorn.Config, on_drain: Callable[[], None] | None = None,
                 owns_signals: bool = True) -> None:
        super().__init__(config)
        self._on_drain = on_drain
        self._owns_signals = owns_signals

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if not self._owns_signals:
            yield
            return
        with super().capture_signals():
            yield

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._on_drain is not None:
            self._on_drain()
        super().handle_exit(sig, frame)


class ServerHandle:
    def __init__(self, server: uvicorn.Server, task: asyncio.Task[None], sock: socket.socket) -> None:
        self.server = server
        self.task = task
        self._sock = sock
        self.port: int = sock.getsockname()[1]
        self.host: str = sock.getsockname()[0]

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    async def stop(self) -> None:
        self.server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await self.task

    async def kill(self) -> None:
        """Stop at once, dropping open connections (what a crashed worker looks like to a client)."""
        self.server.force_exit = True
        self.server.should_exit = True
        for srv in getattr(self.server, "servers", []):
            srv.close()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


def bind(host: str, port: int) -> socket.socket:
    """A listening-ready TCP socket. Bound before the server starts, so port 0 gives a free port we know
    up front. The explicit IPPROTO_TCP matters: asyncio only sets TCP_NODELAY on accepted sockets whose
    proto says TCP, and without it a streamed response's first event waits ~40 ms for the client's
    delayed ACK."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


async def start_server(app: FastAPI, host: str = "127.0.0.1", port: int = 0, *,
                       graceful_timeout_s: float | None = None, on_drain: Callable[[], None] | None = None,
                       install_signal_handlers: bool = False) -> ServerHandle:
    sock = bind(host, port)
    graceful = None if graceful_timeout_s is None else max(1, round(graceful_timeout_s))
    config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=graceful,
                            access_log=False)
    server = DrainingServer(config, on_drain, owns_signals=install_signal_handlers)
    task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            task.result()  # surfaces the start-up error
            raise RuntimeError("server exited during start-up")
        await asyncio.sleep(0.01)
    return ServerHandle(server, task, sock)


def freeze_startup_heap() -> None:
    """Keep what start-up built (modules, tokenizers, templates, settings: all alive until exit) out of the
    cyclic garbage collector's full collections. Those walk every tracked object while holding the GIL,
    and a request that allocates a lot (a 2 MB prompt of 20,000 messages) triggers them: without this the
    event loop stalled ~120 ms under such a request, with it ~35 ms (``kvgate bench hostile``)."""
    gc.collect()
    gc.freeze()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now, for a socket bound a moment later (the demo's KV event sockets)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port
