"""Shared fixtures: the tiny model, and clusters of simulated workers plus a gateway on loopback."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kvgate import serving
from kvgate.assembly import Gateway, create_app
from kvgate.config import GatewaySettings, WorkerConfig
from kvgate.dev.engines import free_ports
from kvgate.serving import ServerHandle, start_server
from kvgate.sim.server import SimWorker
from kvgate.sim.settings import SimSettings
from kvgate.tokens.tinymodel import ensure_tiny_model
from kvgate.tokens.tokenizer import ChatTokenizer

MODEL = "kvgate-tiny"


@pytest.fixture(scope="session")
def model_dir() -> Path:
    return ensure_tiny_model()


@pytest.fixture(scope="session")
def tokenizer(model_dir: Path) -> ChatTokenizer:
    return ChatTokenizer(model_dir)


@dataclass
class Cluster:
    sims: list[tuple[SimWorker, ServerHandle]] = field(default_factory=list)
    gateway_handle: ServerHandle | None = None
    replicas: list[ServerHandle] = field(default_factory=list)
    """Every gateway replica (the first is ``gateway_handle``), sharing the workers and the store."""

    @property
    def urls(self) -> list[str]:
        return [r.url for r in self.replicas]

    @property
    def url(self) -> str:
        assert self.gateway_handle is not None
        return self.gateway_handle.url

    @property
    def gateway(self) -> Gateway:
        assert self.gateway_handle is not None
        gw: Gateway = self.gateway_handle.server.config.app.state.gateway
        return gw

    def worker_by_id(self, wid: str) -> tuple[SimWorker, ServerHandle]:
        for w, h in self.sims:
            if f"127.0.0.1:{h.port}" == wid:
                return w, h
        raise KeyError(wid)

    async def close(self) -> None:
        import asyncio
        import io

        for r in self.replicas:
            try:
                await asyncio.wait_for(r.stop(), 60)
            except TimeoutError:
                # A gateway that does not stop is a bug: say where it is stuck instead of hanging the suite.
                out = io.StringIO()
                for t in asyncio.all_tasks():
                    t.print_stack(file=out)
                raise AssertionError(f"gateway did not stop in 60 s; tasks:\n{out.getvalue()[-8000:]}") from None
        for _, h in self.sims:
            if not h.task.done():
                await h.stop()


# KVGATE_TEST_SIM_ENGINE=sglang runs the gateway suites against simulated SGLang workers.
SIM_ENGINE = os.environ.get("KVGATE_TEST_SIM_ENGINE", "vllm")


@pytest.fixture
async def make_cluster(model_dir: Path) -> AsyncIterator[Any]:
    clusters: list[Cluster] = []

    async def make(n: int = 2, sim: dict[str, Any] | None = None, events: bool = False, tokenizer: bool = True,
                   replicas: int = 1, per_sim: list[dict[str, Any]] | None = None,
                   worker: dict[str, Any] | None = None, extra_workers: list[dict[str, Any]] | None = None,
                   **gw: Any) -> Cluster:
        """``events``: the simulated workers publish KV events and the gateway subscribes (precise mode);
        otherwise the cost model runs on what it routed (approximate mode). ``replicas``: gateways that
        share the workers (and, with ``session_store="redis"``, the conversations). ``per_sim``: settings
        of each simulated worker on top of ``sim``; ``worker``: what the gateway is told of every worker
        (by default the simulator's block size); ``extra_workers``: more workers' settings (servers the
        test runs itself)."""
        c = Cluster()
        clusters.append(c)
        for i in range(n):
            extra: dict[str, Any] = {**(sim or {"speed": 20.0}), **(per_sim[i] if per_sim else {})}
            if events:
                p_events, p_replay = free_ports(2)
                extra["kv_events_endpoint"] = f"tcp://127.0.0.1:{p_events}"
                extra["kv_replay_endpoint"] = f"tcp://127.0.0.1:{p_replay}"
            extra.setdefault("engine", SIM_ENGINE)
            w = SimWorker(SimSettings(model_dir=str(model_dir), hash_seed="0", **extra))
            c.sims.append((w, await start_server(w.build_app())))
        gw.setdefault("health_interval_s", 0.2)
        gw.setdefault("hash_seed", "0")
        if tokenizer:
            gw.setdefault("tokenizers", {MODEL: str(model_dir)})
        settings = GatewaySettings(
            workers=[WorkerConfig(**{"url": h.url, "model": MODEL, "block_size": w.profile.block_size,
                                     "engine": "sim" if w.settings.engine == "vllm" else "sglang",
                                     "kv_events": "auto" if events else None, **(worker or {})}) for w, h in c.sims]
            + [WorkerConfig(**x) for x in extra_workers or ()],
            **gw)
        for _ in range(replicas):
            app = create_app(settings)  # served as `kvgate serve` serves it: shedding at the connection too
            c.replicas.append(await start_server(app, shedding=app.state.gateway.shedding()))
        c.gateway_handle = c.replicas[0]
        return c

    yield make
    for c in clusters:
        await c.close()


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    import os

    for k in list(os.environ):
        if k.startswith("KVGATE_"):
            monkeypatch.delenv(k)
    yield monkeypatch


class Proc:
    """A kvgate process started by a test: bounded start-up wait, log tail on failure, always reaped."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        import os
        import subprocess
        import sys

        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.popen = subprocess.Popen([sys.executable, "-m", "kvgate.cli", *args], stdout=self._log,
                                      stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                                      start_new_session=True)

    def tail(self, n: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    async def wait_http(self, url: str, timeout_s: float = 30.0) -> None:
        import asyncio
        import time

        import httpx

        deadline = time.monotonic() + timeout_s
        async with httpx.AsyncClient() as c:
            while time.monotonic() < deadline:
                if self.popen.poll() is not None:
                    raise RuntimeError(f"process exited with {self.popen.returncode}:\n{self.tail()}")
                try:
                    if (await c.get(url, timeout=1.0)).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.1)
        raise TimeoutError(f"{url} not ready after {timeout_s}s:\n{self.tail()}")

    def signal(self, sig: int) -> None:
        import os

        if self.popen.poll() is None:
            os.killpg(self.popen.pid, sig)

    def stop(self) -> None:
        import signal

        self.signal(signal.SIGKILL)
        self.popen.wait(timeout=10)
        self._log.close()


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Any]:
    procs: list[Proc] = []

    def make(*args: str, env: dict[str, str] | None = None) -> Proc:
        p = Proc(list(args), tmp_path / f"proc{len(procs)}.log", env)
        procs.append(p)
        return p

    yield make
    for p in procs:
        p.stop()


def free_port() -> int:
    """A TCP port nothing listens on now, for a socket a test binds (or must find closed) later."""
    return serving.free_port()
