"""``kvgate serve --workers N``: N gateway processes that act as one pod, each on a core of its own.

The supervisor (like gunicorn's arbiter and uvicorn's ``--workers`` supervisor) binds the listening
socket once and starts N children, each a fresh ``python -m kvgate.cli`` with the same arguments and, in
``_KVGATE_CHILD_SPEC``, its index, the inherited socket and a socketpair to the supervisor (``link``). One
socket rather than N with SO_REUSEPORT: a child that dies or restarts leaves the connections still queued
to its siblings (a SO_REUSEPORT socket's queue is reset with it), and an idle process takes the next
connection rather than a hash picking a busy one.

- A child says ``up`` on its link once it serves; start-up fails as a whole (the child's exit code) if
  one exits before that at first start, since it will not do better the next time (a bad Redis URL).
- Later, a child that exits is started again on the same index, after a pause that doubles while it
  keeps failing (0.5 s to 10 s).
- SIGTERM or SIGINT: every child gets SIGTERM and drains (``/ready`` 503, in-flight requests finish
  within ``drain_timeout_s``); a child still running ``stop_timeout_s`` later is killed. Exit 0 (SIGINT:
  130, as one process). A second signal kills the children at once.
- A child whose supervisor is gone (killed with SIGKILL) sees its link close and drains too.

What the processes share, and how, is in docs/operations.md ("More than one core per pod").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvgate.config import GatewaySettings

log = logging.getLogger("kvgate.supervisor")

UP = b"up"
CHILD_ENV = "_KVGATE_CHILD_SPEC"
"""Not ``KVGATE_*``: that prefix is the settings'."""
RESTART_PAUSE_S = (0.5, 10.0)
STABLE_S = 30.0
"""A child that ran this long before it exited is restarted after the shortest pause again."""


@dataclass(frozen=True)
class ChildSpec:
    """What a child is told (in ``CHILD_ENV``)."""

    index: int
    count: int
    listen_fd: int
    link_fd: int
    run_dir: str

    def encode(self) -> str:
        return f"{self.index}:{self.count}:{self.listen_fd}:{self.link_fd}:{self.run_dir}"

    @classmethod
    def parse(cls, text: str) -> ChildSpec:
        index, count, listen_fd, link_fd, run_dir = text.split(":", 4)
        return cls(int(index), int(count), int(listen_fd), int(link_fd), run_dir)

    def settings(self, settings: GatewaySettings) -> GatewaySettings:
        """This child's settings: a request log of its own (``PATH.pINDEX``: one writer per file, rotation
        included), and the gRPC control API in process 0 only (its port cannot be shared)."""
        update: dict[str, object] = {}
        if settings.request_log:
            update["request_log"] = f"{settings.request_log}.p{self.index}"
        if self.index > 0:
            update["grpc_port"] = None
        return settings.model_copy(update=update)

    def listener(self) -> socket.socket:
        return socket.socket(fileno=self.listen_fd)

    def link(self) -> socket.socket:
        return socket.socket(fileno=self.link_fd)


def announce_and_watch(link: socket.socket, on_orphaned: Callable[[], None]) -> None:
    """Child side: tell the supervisor this child serves, and call ``on_orphaned`` when it is gone."""
    link.sendall(UP)
    link.setblocking(False)
    loop = asyncio.get_running_loop()

    def readable() -> None:
        try:
            data = link.recv(64)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            loop.remove_reader(link.fileno())
            on_orphaned()

    loop.add_reader(link.fileno(), readable)


class Supervisor:
    def __init__(self, argv: list[str], sock: socket.socket, count: int, stop_timeout_s: float,
                 env: dict[str, str]) -> None:
        self._argv = argv
        self._sock = sock
        self._count = count
        self._stop_timeout_s = stop_timeout_s
        self._env = env
        self._procs: dict[int, asyncio.subprocess.Process] = {}
        self._stop = asyncio.Event()
        self._signal: int | None = None
        self._boot_failure: int | None = None

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)
        with tempfile.TemporaryDirectory(prefix="kvgate-") as run_dir:
            booted = [asyncio.Event() for _ in range(self._count)]
            keepers = [asyncio.create_task(self._keep(i, run_dir, booted[i]), name=f"kvgate-child-{i}")
                       for i in range(self._count)]
            up = asyncio.create_task(asyncio.wait([asyncio.create_task(b.wait()) for b in booted]))
            stop = asyncio.create_task(self._stop.wait())
            await asyncio.wait([up, stop], return_when=asyncio.FIRST_COMPLETED)
            if up.done() and not self._stop.is_set():
                pids = ", ".join(str(p.pid) for _, p in sorted(self._procs.items()))
                log.info("%d gateway processes serve (pids %s)", self._count, pids)
            await self._stop.wait()
            up.cancel()
            await self._stop_children()
            for k in keepers:
                k.cancel()
            await asyncio.gather(*keepers, return_exceptions=True)
        self._sock.close()
        if self._boot_failure is not None:
            return self._boot_failure
        return 130 if self._signal == signal.SIGINT else 0

    def _on_signal(self, sig: int) -> None:
        if self._stop.is_set():
            log.warning("second signal: killing the gateway processes")
            for p in self._procs.values():
                with contextlib.suppress(ProcessLookupError):
                    p.kill()
            return
        self._signal = sig
        self._stop.set()

    async def _keep(self, index: int, run_dir: str, booted: asyncio.Event) -> None:
        """Run child ``index`` until the supervisor stops, restarting it when it exits."""
        failures = 0
        loop = asyncio.get_running_loop()
        while not self._stop.is_set():
            proc, link = await self._spawn(index, run_dir)
            is_up = await self._wait_up(proc, link)
            started = loop.time()
            if self._stop.is_set():
                return  # _stop_children ends it
            if is_up:
                booted.set()
            elif not booted.is_set():
                log.error("gateway process %d exited with %s during start-up", index, proc.returncode)
                self._boot_failure = proc.returncode if proc.returncode and proc.returncode > 0 else 1
                self._stop.set()
                return
            code = await proc.wait()
            link.close()
            if self._stop.is_set():
                return
            failures = 0 if loop.time() - started > STABLE_S else failures + 1
            pause = min(RESTART_PAUSE_S[1], RESTART_PAUSE_S[0] * 2 ** max(0, failures - 1))
            log.warning("gateway process %d (pid %d) exited with %s; starting it again in %.1f s",
                        index, proc.pid, code, pause)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), pause)

    async def _spawn(self, index: int, run_dir: str) -> tuple[asyncio.subprocess.Process, socket.socket]:
        ours, theirs = socket.socketpair()
        spec = ChildSpec(index, self._count, self._sock.fileno(), theirs.fileno(), run_dir)
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "kvgate.cli", *self._argv,
                pass_fds=(self._sock.fileno(), theirs.fileno()), env={**self._env, CHILD_ENV: spec.encode()})
        finally:
            theirs.close()
        ours.setblocking(False)
        self._procs[index] = proc
        log.info("gateway process %d started (pid %d)", index, proc.pid)
        return proc, ours

    async def _wait_up(self, proc: asyncio.subprocess.Process, link: socket.socket) -> bool:
        """True once the child said it serves; False if it exited (or the supervisor stops) first."""
        loop = asyncio.get_running_loop()
        said = asyncio.create_task(loop.sock_recv(link, len(UP)))
        exited = asyncio.create_task(proc.wait())
        stop = asyncio.create_task(self._stop.wait())
        await asyncio.wait([said, exited, stop], return_when=asyncio.FIRST_COMPLETED)
        for t in (said, exited, stop):
            t.cancel()
        return said.done() and not said.cancelled() and said.exception() is None and said.result() == UP

    async def _stop_children(self) -> None:
        live = [p for p in self._procs.values() if p.returncode is None]
        for p in live:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(asyncio.gather(*(p.wait() for p in live)), self._stop_timeout_s)
        except TimeoutError:
            for p in live:
                if p.returncode is None:
                    log.error("gateway process pid %d still running %.0f s after SIGTERM: killed", p.pid,
                              self._stop_timeout_s)
                    with contextlib.suppress(ProcessLookupError):
                        p.kill()
            await asyncio.gather(*(p.wait() for p in live))
        log.info("gateway processes stopped (exit codes %s)", [p.returncode for p in live])


def child_env(base: dict[str, str], request_log: str | None, request_log_key: str | None) -> dict[str, str]:
    """The children's environment: one request-log key for all, so their logs replay together."""
    env = dict(base)
    if request_log and not request_log_key:
        env["KVGATE_REQUEST_LOG_KEY"] = os.urandom(32).hex()
    return env
