"""What tracing costs the request path: a gateway and one simulated worker (1000x real speed, so the
engine's time is next to nothing) in one process; agents run tool loops of streamed chat requests
through it with tracing off, on (every request sampled, spans batched to an exporter that drops them)
and on with nothing sampled, interleaved round by round. Per request: the client's wall time (median,
p90) and the process's CPU time (gateway, worker and client together: the differences are tracing's).

Run against an older checkout (``PYTHONPATH=<checkout> python kvgate/bench/tracing.py``) it measures that
checkout's request path as "before" (a gateway without tracing has only that row).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import httpx

from kvgate.assembly import create_app
from kvgate.config import GatewaySettings, WorkerConfig
from kvgate.serving import start_server
from kvgate.sim.server import SimWorker
from kvgate.sim.settings import SimSettings
from kvgate.tokens.tinymodel import ensure_tiny_model

TOOLS = [{"type": "function", "function": {"name": "search", "description": "search the code",
                                            "parameters": {"type": "object"}}}]


def _tracings() -> dict[str, Any]:
    """The modes this checkout supports: name -> the create_app keyword that selects it."""
    if "tracing" not in inspect.signature(create_app).parameters:
        return {"before (no tracing)": {}}
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF

    from kvgate.gateway.tracing import Tracing

    class Drop(SpanExporter):
        def export(self, spans: Sequence[Any]) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    on = TracerProvider()
    on.add_span_processor(BatchSpanProcessor(Drop()))
    return {"off": {"tracing": Tracing()}, "on, all sampled": {"tracing": Tracing(on)},
            "on, none sampled": {"tracing": Tracing(TracerProvider(sampler=ALWAYS_OFF))}}


def _tag(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name)


async def _agent(client: httpx.AsyncClient, url: str, conv: str, steps: int, lat: list[float]) -> None:
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "You are an agent. " * 60},
                                  {"role": "user", "content": f"task {conv}"}]
    for i in range(steps):
        body = {"model": "kvgate-tiny", "messages": msgs, "tools": TOOLS, "stream": True,
                "sim": {"tool_calls": 1, "reasoning_tokens": 16, "answer_tokens": 8}}
        t0 = time.perf_counter()
        reply: dict[str, Any] = {"role": "assistant", "content": "", "tool_calls": []}
        async with client.stream("POST", url + "/v1/chat/completions", json=body,
                                 headers={"x-conversation-id": conv}) as r:
            if r.status_code != 200:
                raise RuntimeError(f"gateway answered {r.status_code}: {(await r.aread())[:300]!r}")
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    for ch in json.loads(line[6:]).get("choices", []):
                        reply["content"] += ch["delta"].get("content") or ""
                        reply["tool_calls"] += ch["delta"].get("tool_calls") or []
        lat.append(time.perf_counter() - t0)
        calls = [{"id": c["id"], "type": "function", "function": c["function"]} for c in reply["tool_calls"]]
        msgs += [{**reply, "tool_calls": calls}, {"role": "tool", "tool_call_id": calls[0]["id"],
                                                  "content": f"result {i} " * 20}]


async def _round(url: str, agents: int, steps: int, tag: str) -> tuple[list[float], float]:
    lat: list[float] = []
    async with httpx.AsyncClient(timeout=30) as client:
        c0 = time.process_time()
        await asyncio.gather(*(_agent(client, url, f"{tag}-{a}", steps, lat) for a in range(agents)))
        cpu = time.process_time() - c0
    return lat, cpu


async def run(rounds: int = 5, agents: int = 4, steps: int = 10) -> str:
    model_dir = ensure_tiny_model()
    w = SimWorker(SimSettings(model_dir=str(model_dir), hash_seed="0", speed=1000.0))
    sim = await start_server(w.build_app())
    modes = _tracings()
    gateways = {}
    for name, kw in modes.items():
        settings = GatewaySettings(workers=[WorkerConfig(url=sim.url, model="kvgate-tiny", engine="sim",
                                                         block_size=w.profile.block_size)],
                                   tokenizers={"kvgate-tiny": str(model_dir)}, hash_seed="0")
        gateways[name] = await start_server(create_app(settings, **kw))
    lat: dict[str, list[float]] = {n: [] for n in modes}
    cpu: dict[str, float] = dict.fromkeys(modes, 0.0)
    try:
        for name, gw in gateways.items():  # warm-up: tokenizer caches, connections
            await _round(gw.url, agents, 2, f"warm-{_tag(name)}")
        for r in range(rounds):
            for name, gw in gateways.items():
                got, c = await _round(gw.url, agents, steps, f"r{r}-{_tag(name)}")
                lat[name] += got
                cpu[name] += c
    finally:
        for gw in gateways.values():
            await gw.stop()
        await sim.stop()
    n = rounds * agents * steps
    base = statistics.median(lat[next(iter(modes))])
    head = f"{'tracing':<20} {'requests':>8} {'median ms':>10} {'p90 ms':>8} {'CPU ms/request':>15} {'vs first':>9}"
    out = [head, "-" * len(head)]
    base_cpu = cpu[next(iter(modes))] / n
    for name in modes:
        xs = sorted(lat[name])
        med = statistics.median(xs)
        per = cpu[name] / n
        out.append(f"{name:<20} {len(xs):>8} {med * 1000:>10.2f} {xs[int(0.9 * (len(xs) - 1))] * 1000:>8.2f} "
                   f"{per * 1000:>15.3f} {(med - base) * 1e6:>+7.0f}us / cpu {(per - base_cpu) * 1e6:+.0f}us")
    return "\n".join(out)


if __name__ == "__main__":
    print(asyncio.run(run(*(int(a) for a in sys.argv[1:]))))
