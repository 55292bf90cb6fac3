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
from tests.conftest import MODEL
from tests.envoy import Envoy

VOLATILE = ("t", "end", "ttft", "worker", "waited")
"""Request-log fields that differ between two runs of one turn (times, the worker's address)."""


async def run_turn(model_dir: Path, tmp: Path, front: str, stream: bool) -> dict[str, Any]:
    w = SimWorker(SimSettings(model_dir=str(model_dir), hash_seed="0", speed=20.0))
    worker = await start_server(w.build_app())
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    log = tmp / f"{front}-{stream}.jsonl"
    settings = GatewaySettings(workers=[WorkerConfig(url=worker.url, model=MODEL, engine="sim",
                                                     block_size=w.profile.block_size)],
                               tokenizers={MODEL: str(model_dir)}, hash_seed="0", request_log=str(log),
                               request_log_key="ab" * 16,
                               **({"epp_port": 0} if front == "epp" else {}))
    gw = await start_server(create_app(settings, tracing=Tracing(provider)))
    handles: list[ServerHandle] = [gw, worker]
    envoy = None
    try:
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
        (ws,) = state.pool.all()
        pool = {"in_flight": ws.in_flight, "pending": ws.pending_requests, "timed": ws.service_s is not None}
        rec = await state.store.peek("c1")
    finally:
        for hd in handles:
            await hd.stop()
        if envoy is not None:
            await envoy.close()
    lines = [json.loads(x) for x in log.read_text().splitlines()[1:]]  # after the header
    spans = sorted(s.name for s in exporter.get_finished_spans())
    return {"pool": pool, "log": [{k: v for k, v in x.items() if k not in VOLATILE} for x in lines],
            "spans": spans, "turns": len(rec.turns) if rec is not None else 0}


@pytest.mark.parametrize("stream", [True, False])
async def test_one_turn_ends_alike_through_the_proxy_and_the_picker(model_dir: Path, tmp_path: Path,
                                                                    stream: bool) -> None:
    proxy = await run_turn(model_dir, tmp_path, "proxy", stream)
    epp = await run_turn(model_dir, tmp_path, "epp", stream)
    assert proxy["pool"] == {"in_flight": 0, "pending": 0, "timed": True}
    assert epp["pool"] == proxy["pool"]
    assert len(proxy["log"]) == 1 and epp["log"] == proxy["log"]
    assert proxy["turns"] == epp["turns"] == 1
    assert "POST /v1/chat/completions" in proxy["spans"] and epp["spans"] == proxy["spans"]
