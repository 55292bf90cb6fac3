"""The peer routers kvgate is benchmarked against install from PyPI and route to the same workers.

Flags that matter on CPU workers (block size 128) are collected in docs/real-engines.md.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from kvgate.dev.engines import EngineSet, ensure_router, free_port
from tests.engine.conftest import Pair


@pytest.fixture
def routers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineSet]:
    s = EngineSet(run_dir=tmp_path_factory.mktemp("routers"))
    yield s
    s.stop()


def chat(url: str, conv: str, turn: int, headers: dict[str, str]) -> dict[str, Any]:
    msgs = [{"role": "system", "content": "You are a careful agent. " * 60},
            {"role": "user", "content": f"conversation {conv}, turn {turn}"}]
    r = httpx.post(url + "/v1/chat/completions", json={"model": "kvgate-tiny", "messages": msgs, "max_tokens": 4},
                   headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


@pytest.mark.parametrize(("name", "args"), [
    ("sglang-router", ["--policy", "cache_aware"]),
    ("vllm-router", ["--policy", "consistent_hash"]),
    ("vllm-router", ["--policy", "cache_aware"]),
])
def test_peer_routes_chat_to_real_workers(pair: Pair, routers: EngineSet, name: str, args: list[str]) -> None:
    rep = ensure_router(name)
    assert rep.venv.exists()
    port = free_port()
    routers.start_router(name, ["--worker-urls", pair.a.url, pair.b.url, "--prometheus-port", str(free_port()),
                                *args], port)
    url = f"http://127.0.0.1:{port}"
    # Routers register their workers in the background after /health is up: wait, bounded.
    deadline = time.monotonic() + 90
    while True:
        r = httpx.post(url + "/v1/completions", json={"model": "kvgate-tiny", "prompt": "warm", "max_tokens": 1},
                       timeout=60)
        if r.status_code == 200:
            break
        assert time.monotonic() < deadline, f"{name} never became routable: {r.status_code} {r.text}"
        time.sleep(1)
    first = chat(url, "p1", 0, {"x-session-id": "p1"})
    again = chat(url, "p1", 0, {"x-session-id": "p1"})
    assert first["usage"]["prompt_tokens"] == again["usage"]["prompt_tokens"] > 128
    # A repeated conversation lands where its prefix is: both policies are prefix- or session-sticky.
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
