"""``kvgate bench stores``: what sharing conversations in Redis costs a request, against the memory store.

One agent conversation grows turn by turn (tool results and user turns, ~9k tokens at the end) through
a gateway on a simulated worker, once with the memory store and once with the Redis store (fresh worker
each, runs interleaved request by request so both see the same machine). Reported: the time to first
token and to the last byte, p50 and p99, and the Redis round trips and bytes per request, split into
the request path (conversation reads and writes, timer and observation commands) and the replica's
background ticks.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvgate.assembly import Gateway, create_app, make_client
from kvgate.config import GatewaySettings, WorkerConfig
from kvgate.kvstore.redis_conversations import RedisConversationStore
from kvgate.kvstore.redis_fleet import RedisFleet
from kvgate.serving import ServerHandle, start_server
from kvgate.sim.server import SimWorker
from kvgate.sim.settings import SimSettings
from kvgate.tokens.tinymodel import ensure_tiny_model

MODEL = "kvgate-tiny"


@dataclass
class Run:
    store: str
    ttft_ms: list[float] = field(default_factory=list)
    total_ms: list[float] = field(default_factory=list)


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    k = (len(s) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


async def _turn(http: httpx.AsyncClient, url: str, msgs: list[dict[str, Any]], run: Run) -> dict[str, Any]:
    body = {"model": MODEL, "messages": msgs, "stream": True, "max_tokens": 64,
            "sim": {"reasoning_tokens": 24, "answer_tokens": 16, "tool_calls": 0}}
    t0 = time.perf_counter()
    ttft = None
    text = ""
    async with http.stream("POST", url + "/v1/chat/completions", json=body,
                           headers={"x-conversation-id": "bench"}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"gateway answered {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                obj = json.loads(line[6:])
                for ch in obj.get("choices", []):
                    d = ch.get("delta", {})
                    if ttft is None and (d.get("content") or d.get("reasoning")):
                        ttft = time.perf_counter() - t0
                    text += d.get("content") or ""
    run.ttft_ms.append((ttft or 0.0) * 1000)
    run.total_ms.append((time.perf_counter() - t0) * 1000)
    return {"role": "assistant", "content": text}


async def _gateway(store: str, prefix: str) -> tuple[ServerHandle, ServerHandle, Gateway]:
    model_dir = ensure_tiny_model()
    w = SimWorker(SimSettings(model_dir=str(model_dir), profile="h100-llama3-8b", hash_seed="0", speed=1.0,
                              max_model_len=32768))
    sim = await start_server(w.build_app())
    gw = await start_server(create_app(GatewaySettings(
        workers=[WorkerConfig(url=sim.url, model=MODEL, engine="sim", block_size=16)], session_store=store,
        redis_prefix=prefix, tokenizers={MODEL: str(model_dir)}, hash_seed="0")))
    app: Any = gw.server.config.app
    return sim, gw, app.state.gateway


async def measure(turns: int = 40) -> tuple[list[Run], dict[str, float]]:
    prefix = f"kvgate-bench:{uuid.uuid4().hex[:8]}:"
    servers = [await _gateway("memory", prefix), await _gateway("redis", prefix)]
    runs = [Run("memory"), Run("redis")]
    msgs: list[list[dict[str, Any]]] = [[{"role": "system", "content": "You are an agent. " * 40}] for _ in runs]
    try:
        async with make_client(60.0) as http:
            for i in range(turns):
                for k, (_, gw, _) in enumerate(servers):
                    msgs[k].append({"role": "user", "content": f"step {i}: " + "tool output line " * 40})
                    msgs[k].append(await _turn(http, gw.url, msgs[k], runs[k]))
        redis_gw = servers[1][2]
        conv = redis_gw.store
        fleet = redis_gw.fleet
        assert isinstance(conv, RedisConversationStore) and isinstance(fleet, RedisFleet)
        ticks = redis_gw.runtime.ticks
        per = {"requests": turns, "conversation round trips": conv.round_trips / turns,
               "conversation bytes read": conv.bytes_read / turns,
               "conversation bytes written": conv.bytes_written / turns,
               "fleet round trips (timers, observations, reservations)": (fleet.round_trips - 3 * ticks) / turns,
               "background: fleet round trips per tick": 3.0, "ticks per second": 1 / redis_gw.runtime.tick_s}
        return runs, per
    finally:
        for sim, gw, _ in servers:
            await gw.stop()
            await sim.stop()


def table(runs: list[Run], per: dict[str, float]) -> str:
    mem = runs[0]
    lines = ["| store | TTFT p50 (ms) | TTFT p99 | last byte p50 | last byte p99 | added TTFT p50 / p99 vs memory |",
             "|---|---|---|---|---|---|"]
    for r in runs:
        d50, d99 = pct(r.ttft_ms, .5) - pct(mem.ttft_ms, .5), pct(r.ttft_ms, .99) - pct(mem.ttft_ms, .99)
        lines.append(f"| {r.store} | {pct(r.ttft_ms, .5):.2f} | {pct(r.ttft_ms, .99):.2f} | "
                     f"{pct(r.total_ms, .5):.2f} | {pct(r.total_ms, .99):.2f} | {d50:+.2f} / {d99:+.2f} |")
    lines += ["", "| Redis cost per request | |", "|---|---|"]
    lines += [f"| {k} | {v:,.1f} |" for k, v in per.items()]
    return "\n".join(lines) + "\n"


def run(turns: int = 40) -> str:
    runs, per = asyncio.run(measure(turns))
    text = table(runs, per)
    print(text)
    return text
