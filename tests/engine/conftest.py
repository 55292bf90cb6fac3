"""Real engines for the ``engine`` tests: two vLLM workers on CPU, each on its own core.

Worker A hashes with ``sha256`` and has the default KV cache; worker B hashes with ``sha256_cbor`` and
has 40 blocks (5,120 tokens), small enough to evict. Both publish KV events with a replay socket.
``KVGATE_ENGINE_TESTS=0`` skips the suite (a machine that cannot run vLLM on CPU).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import msgpack
import pytest
import zmq
import zmq.asyncio

from kvgate.dev.engines import EngineSet, Proc, VllmWorker, ensure_model, ensure_vllm, free_port

SMALL_BLOCKS = 40


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/engine/" in str(item.fspath):
            item.add_marker(pytest.mark.engine)
            if os.environ.get("KVGATE_ENGINE_TESTS", "1") == "0":
                item.add_marker(pytest.mark.skip(reason="KVGATE_ENGINE_TESTS=0"))


@dataclass
class Worker:
    proc: Proc
    spec: VllmWorker

    @property
    def url(self) -> str:
        return self.proc.url

    @property
    def events(self) -> str:
        return f"tcp://127.0.0.1:{self.spec.kv_events_port}"

    @property
    def replay(self) -> str:
        return f"tcp://127.0.0.1:{self.spec.kv_replay_port}"


@dataclass
class Pair:
    a: Worker
    b: Worker
    model: Path
    startup_s: dict[str, float]


@pytest.fixture(scope="session")
def real_model() -> Path:
    return ensure_model(ensure_vllm().venv)


@pytest.fixture(scope="session")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineSet]:
    s = EngineSet(run_dir=tmp_path_factory.mktemp("engines"))
    yield s
    s.stop()


@pytest.fixture(scope="session")
def pair(engines: EngineSet, real_model: Path) -> Pair:
    specs = [
        VllmWorker(port=free_port(), core=0, hash_algo="sha256", kv_events_port=free_port(),
                   kv_replay_port=free_port()),
        VllmWorker(port=free_port(), core=1 % (os.cpu_count() or 1), hash_algo="sha256_cbor",
                   kv_events_port=free_port(), kv_replay_port=free_port(), num_gpu_blocks=SMALL_BLOCKS),
    ]
    procs = engines.start_vllm(specs, real_model)
    return Pair(Worker(procs[0], specs[0]), Worker(procs[1], specs[1]), real_model, dict(engines.startup_s))


class EventTap:
    """A SUB socket on a worker's KV events; ``drain`` returns what arrived until the stream goes quiet."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.connect(endpoint)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")

    async def ready(self) -> None:
        await asyncio.sleep(0.3)  # a SUB that has not joined yet would miss the first messages

    async def drain(self, quiet_ms: int = 400) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        while await self.sock.poll(quiet_ms):
            _, _, payload = await self.sock.recv_multipart()
            out.extend(msgpack.unpackb(payload)[1])
        return out

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


async def reset_cache(url: str) -> None:
    async with httpx.AsyncClient() as c:
        r = await c.post(url + "/reset_prefix_cache")
        assert r.status_code == 200, r.text


async def complete(url: str, prompt: list[int], salt: str | None = None, max_tokens: int = 1) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "kvgate-tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    if salt:
        body["cache_salt"] = salt
    async with httpx.AsyncClient(timeout=120) as c:
        r = await c.post(url + "/v1/completions", json=body)
        assert r.status_code == 200, r.text
        usage: dict[str, Any] = r.json()["usage"]
        return usage


def cached(usage: dict[str, Any]) -> int:
    return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
