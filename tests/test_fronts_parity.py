"""One turn through kvgate's proxy and the same turn through its endpoint picker (behind the test data
plane, tests/envoy.py) end the same way (gateway/lifecycle.py): the worker pool's state, the request-log
line and the spans. Before, the picker's copy of the exchange's end learned no service time, logged no
streamed turn and traced nothing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvgate.assembly import create_app
from kvgate.config import GatewaySettings, WorkerConfig
from kvgate.gateway.tracing import Tracing
from kvgate.serving import ServerHandle, start_server
from kvgate.sim.server import SimWorker
from kvgate.sim.settings import SimSettings
from tests.conftest import MODEL, free_port
from tests.envoy import Envoy
from tests.test_faults import CrashingWorker

VOLATILE = ("t", "end", "ttft", "worker", "waited")
"""Request-log fields that differ between two runs of one turn (times, the worker's address)."""


async def run_turn(model_dir: Path, tmp: Path, front: str, stream: bool, moved: bool = False) -> dict[str, Any]:
    """``moved``: the worker kvgate picks first stopped listening after its health check; the proxy retries
    on the other one, and Envoy's fallback goes there (its slot and turn move there)."""
    w = SimWorker(SimSettings(model_dir=str(model_dir), hash_seed="0", speed=20.0))
    gone = CrashingWorker(b"") if moved else None
    # Round robin starts at the first worker in id order: the gone one gets the lower port.
    ports = sorted((free_port() for _ in range(2)), key=lambda p: f"127.0.0.1:{p}")
    worker = await start_server(w.build_app(), port=ports[1] if moved else 0)
    urls = [await gone.start(ports[0])] if gone is not None else []
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    log = tmp / f"{front}-{stream}-{moved}.jsonl"
    settings = GatewaySettings(workers=[WorkerConfig(url=u, model=MODEL, engine="sim", block_size=w.profile.block_size)
                                        for u in [*urls, worker.url]],
                               tokenizers={MODEL: str(model_dir)}, hash_seed="0", request_log=str(log),
                               request_log_key="ab" * 16,
                               **({"epp_port": 0} if front == "epp" else {}),
                               **({"policy": "round_robin", "health_interval_s": 30} if moved else {}))
    gw = await start_server(create_app(settings, tracing=Tracing(provider)))
    handles: list[ServerHandle] = [gw, worker]
    envoy = None
    try:
        if gone is not None:
            assert gone.server is not None
            gone.server.close()
            await gone.server.wait_closed()
        url = gw.url
        if front == "epp":
            envoy = Envoy(f"127.0.0.1:{gw.server.config.app.state.grpc.epp_port}")
            dp = await start_server(envoy.app)
            handles.insert(0, dp)
            url = dp.url
        body = {"model": MODEL, "messages": [{"role": "system", "content": "You are terse. " * 40},
                                             {"role": "user", "content": "hello"}], "stream": stream,
                "sim": {"tool_calls": 1}, "tools": [{"type": "function", "function": {"name": "f"}}]}
        async with httpx.AsyncClient(timeout=30) as h:
            r = await h.post(url + "/v1/chat/completions", json=body, headers={"x-conversation-id": "c1"})
            assert r.status_code == 200
            r.read()
        state = gw.server.config.app.state.gateway
        pool = {"in_flight": sum(ws.in_flight for ws in state.pool.all()),
                "pending": sum(ws.pending_requests for ws in state.pool.all()),
                "timed": [ws.service_s is not None for ws in sorted(state.pool.all(), key=lambda ws: ws.id)]}
        rec = await state.store.peek("c1")
    finally:
        for hd in handles:
            await hd.stop()
        if envoy is not None:
            await envoy.close()
    lines = [json.loads(x) for x in log.read_text().splitlines()[1:]]  # after the header
    spans = sorted(s.name for s in exporter.get_finished_spans())
    return {"pool": pool, "log": [{k: v for k, v in x.items() if k not in VOLATILE} for x in lines],
            "spans": spans, "turns": len(rec.turns) if rec is not None else 0,
            "home": rec.home == WorkerConfig(url=worker.url, model=MODEL).id if rec is not None else None}


@pytest.mark.parametrize("stream", [True, False])
async def test_one_turn_ends_alike_through_the_proxy_and_the_picker(model_dir: Path, tmp_path: Path,
                                                                    stream: bool) -> None:
    proxy = await run_turn(model_dir, tmp_path, "proxy", stream)
    epp = await run_turn(model_dir, tmp_path, "epp", stream)
    assert proxy["pool"] == {"in_flight": 0, "pending": 0, "timed": [True]}
    assert epp["pool"] == proxy["pool"]
    assert len(proxy["log"]) == 1 and epp["log"] == proxy["log"]
    assert proxy["turns"] == epp["turns"] == 1
    assert "POST /v1/chat/completions" in proxy["spans"] and epp["spans"] == proxy["spans"]


@pytest.mark.parametrize("stream", [True, False])
async def test_a_turn_that_moved_to_another_worker_ends_alike(model_dir: Path, tmp_path: Path, stream: bool) -> None:
    # The proxy retries on the other worker (the first never had the request); behind Envoy the fallback
    # endpoint serves and the picker moves the exchange there (gateway/lifecycle.py ``moved``). Either way
    # the first worker's slot is back untimed, the second's back with its service time, the turn is the
    # second's, and the one request-log line is alike but for why it went there.
    proxy = await run_turn(model_dir, tmp_path, "proxy", stream, moved=True)
    epp = await run_turn(model_dir, tmp_path, "epp", stream, moved=True)
    assert proxy["pool"] == epp["pool"] == {"in_flight": 0, "pending": 0, "timed": [False, True]}
    assert proxy["turns"] == epp["turns"] == 1 and proxy["home"] is epp["home"] is True
    assert epp["log"][0]["reason"] == "fallback"
    why = ("reason", "expected")
    assert len(proxy["log"]) == 1 and [{k: v for k, v in x.items() if k not in why} for x in epp["log"]] \
        == [{k: v for k, v in x.items() if k not in why} for x in proxy["log"]]
    assert set(epp["spans"]) == set(proxy["spans"])  # the proxy's has a second attempt's route and call
