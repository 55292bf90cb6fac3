"""Running ASGI apps under uvicorn inside an existing event loop (CLI, demo, tests, benchmarks).

uvicorn's public API: ``Server.serve(sockets=...)``, ``Server.capture_signals`` and ``Server.handle_exit``
(overridden), ``started``/``should_exit``/``force_exit``; and its httptools protocol, subclassed for the
connection limits (kvgate/connections.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import gc
import random
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Literal

import uvicorn
from starlette.types import ASGIApp

from kvgate.connections import LISTEN_QUEUE, ConnectionPolicy, GuardedConfig, Shedding
from kvgate.settings.limits import ConnectionLimits

Loop = Literal["auto", "asyncio", "uvloop"]
LOOPS: tuple[Loop, ...] = ("auto", "asyncio", "uvloop")


def loop_factory(loop: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The event loop a serving process runs on, chosen as uvicorn's ``--loop`` is: ``auto`` is uvloop when
    it is installed (``uvicorn[standard]`` installs it). None: asyncio's default loop."""
    if loop == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if loop == "uvloop":
            raise
        return None
    return uvloop.new_event_loop


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
        name = sock.getsockname()
        # A Unix socket's name is its path: no port.
        self.host: str = name if isinstance(name, str) else name[0]
        self.port: int = 0 if isinstance(name, str) else name[1]

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
    for _ in range(8):
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        # SO_REUSEADDR (a server restarted on its port binds it over the old connections) is set after
        # bind for port 0: set before, Linux may hand out a port an outgoing connection holds, and
        # listen() then fails EADDRINUSE (seen in CI). Set after, the connections this socket accepts
        # still inherit it. Listening here makes any such failure ours to retry.
        try:
            if port:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.listen(LISTEN_QUEUE)
        except OSError as e:
            sock.close()
            if port or e.errno != errno.EADDRINUSE:
                raise
            continue
        return sock
    raise OSError(errno.EADDRINUSE, f"no free port on {host}")


async def start_server(app: ASGIApp, host: str = "127.0.0.1", port: int = 0, *,
                       graceful_timeout_s: float | None = 10.0, on_drain: Callable[[], None] | None = None,
                       install_signal_handlers: bool = False, limits: ConnectionLimits | None = None,
                       sock: socket.socket | None = None, accept_batch: int | None = None,
                       shedding: Shedding | None = None) -> ServerHandle:
    """``limits``: header deadline and size, keep-alive, connection cap (the defaults unless given).
    ``graceful_timeout_s``: how long a stop waits for open connections and requests (None: for ever —
    a peer that keeps a connection open then holds the stop; a test suite hung on one once).
    ``sock``: a listening socket to serve instead of binding ``host``:``port`` (a ``kvgate serve --workers``
    child serves the one its supervisor bound; kvgate/supervisor.py). ``accept_batch``: connections taken
    per wake-up instead of the connection policy's (a child sharing its socket takes few, so that a burst
    of new connections is spread over the processes rather than all taken by the first one awake).
    ``shedding``: inference requests refused at the connection while the loop runs late."""
    sock = sock if sock is not None else bind(host, port)
    graceful = None if graceful_timeout_s is None else max(1, round(graceful_timeout_s))
    policy = ConnectionPolicy.from_limits(limits or ConnectionLimits())
    if accept_batch is not None:
        policy = dataclasses.replace(policy, accept_batch=min(accept_batch, policy.accept_batch))
    config = GuardedConfig(app, policy, shedding, log_level="warning",
                           lifespan="on", timeout_graceful_shutdown=graceful, access_log=False)
    server = DrainingServer(config, on_drain, owns_signals=install_signal_handlers)
    task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            task.result()  # surfaces the start-up error
            raise RuntimeError("server exited during start-up")
        await asyncio.sleep(0.01)
    # asyncio listened with its accept batch as the queue length; the kernel's queue stays the full one.
    sock.listen(LISTEN_QUEUE)
    return ServerHandle(server, task, sock)


async def start_unix_server(app: ASGIApp, path: str) -> ServerHandle:
    """``app`` on a Unix socket at ``path``, without its lifespan (the app's own server runs that): the
    private door through which a ``--workers`` child answers its siblings (kvgate/podview.py)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
        sock.listen(64)
    except OSError:
        sock.close()
        raise
    config = uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False, timeout_graceful_shutdown=2)
    server = DrainingServer(config, owns_signals=False)
    task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            task.result()
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
    """A TCP port nothing listens on now, for a socket bound a moment later (KV event sockets, a process
    started next). Drawn below the kernel's ephemeral range: there, an outgoing connection opened in the
    meantime (a starting vLLM opens many) could be handed the same port before it is bound."""
    lo, hi = 20000, 32000
    try:
        eph_lo = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
        hi = min(hi, eph_lo)
        lo = min(lo, hi - 1000)
    except (OSError, ValueError, IndexError):
        pass
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(lo, hi)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise OSError(errno.EADDRINUSE, f"no free port below the ephemeral range on {host}")
