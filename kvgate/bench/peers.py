"""kvgate against the peer routers as real processes, in front of simulated workers in real time.

A time-compressed slice of the Mooncake trace is replayed over HTTP (streaming ``/v1/completions`` with
text prompts, one deterministic ~512-token text per trace block) through each router in turn: kvgate
(``kvgate serve``, cost model, KV events), ``sglang-router --policy cache_aware``, ``vllm-router`` in
``cache_aware`` and ``consistent_hash`` modes (its ``kv_aware`` cannot index vLLM 0.32 HTTP workers:
docs/real-engines.md). Every run gets fresh worker processes, so no router inherits another's cache.
The client sends the conversation key as ``x-conversation-id`` and ``x-session-id`` to all of them.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from kvgate.bench.report import Row
from kvgate.bench.trace import TraceRequest, load_mooncake
from kvgate.dev.engines import EngineSet, Proc, ensure_router, free_ports, spawn, wait_http
from kvgate.tokens.tinymodel import WORDS, ensure_tiny_model

MODEL = "kvgate-tiny"


def chunk_text(hash_id: int, words: int = 512) -> str:
    rng = random.Random(hash_id)
    return " " + " ".join(rng.choice(WORDS) for _ in range(words))


def prompt_text(r: TraceRequest, scale: float) -> str:
    n_words = max(8, int(r.input_length * scale))
    parts = []
    for h in r.hash_ids:
        parts.append(chunk_text(h))
        if len(parts) * 512 >= n_words:
            break
    text = "".join(parts)
    return " ".join(text.split(" ")[: n_words + 1])


@dataclass
class Sample:
    ttft_ms: float
    prompt: int
    cached: int
    output: int
    ok: bool
    error: str = ""
    """Why a failed request failed (status and body, or the client's exception), for the report."""


async def replay(url: str, trace: list[TraceRequest], scale: float, max_output: int) -> tuple[list[Sample], float]:
    t0 = time.monotonic()
    out: list[Sample] = []
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)

    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        async def one(r: TraceRequest) -> None:
            await asyncio.sleep(max(0.0, r.arrival_s - (time.monotonic() - t0)))
            body = {"model": MODEL, "prompt": prompt_text(r, scale), "max_tokens": min(max_output, r.output_length),
                    "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
            key = r.conversation_key
            start = time.monotonic()
            ttft, usage, error = None, None, ""
            try:
                async with client.stream("POST", url + "/v1/completions", json=body,
                                         headers={"x-conversation-id": key, "x-session-id": key,
                                                  "x-smg-routing-key": key}) as resp:
                    async for line in resp.aiter_lines():
                        if resp.status_code != 200:
                            error = f"{resp.status_code} {line[:200]}"
                            break
                        if line.startswith("data: {\"error\""):
                            error = line[6:206]
                        if not line.startswith("data: {"):
                            continue
                        obj = json.loads(line[6:])
                        if ttft is None and obj.get("choices") and obj["choices"][0].get("text"):
                            ttft = (time.monotonic() - start) * 1000
                        if obj.get("usage"):
                            usage = obj["usage"]
                ok = resp.status_code == 200 and ttft is not None and usage is not None
                if not ok and not error:
                    error = f"{resp.status_code}, {'no token' if ttft is None else 'no usage'} in the stream"
            except httpx.HTTPError as exc:
                ok, error = False, repr(exc)[:200]
            u = usage or {}
            out.append(Sample(ttft or 0.0, int(u.get("prompt_tokens") or 0),
                              int((u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0),
                              int(u.get("completion_tokens") or 0), ok, error))

        await asyncio.gather(*(one(r) for r in trace))
    return out, time.monotonic() - t0


def failures(samples: list[Sample]) -> str:
    """How many failed and the commonest reason, for a table cell (a count alone explains nothing)."""
    from collections import Counter

    errors = Counter(s.error or "unknown" for s in samples if not s.ok)
    if not errors:
        return ""
    reason, n = errors.most_common(1)[0]
    reason = " ".join(reason.split()).replace("|", "/")[:120]
    return f"{sum(errors.values())} failed; {n}x: {reason}"


def _row(name: str, samples: list[Sample], wall_s: float) -> Row:
    good = [s for s in samples if s.ok]
    ttft = sorted(s.ttft_ms for s in good)
    if not ttft:
        return Row(f"{name} (all {failures(samples)})", 0.0)
    reuse = sum(s.cached for s in good) / max(1, sum(s.prompt for s in good))
    label = name if len(good) == len(samples) else f"{name} ({failures(samples)})"
    return Row(label, reuse, sum(s.prompt - s.cached for s in good) / 1e6, statistics.mean(ttft),
               ttft[len(ttft) // 2], ttft[min(len(ttft) - 1, int(len(ttft) * 0.99))],
               sum(s.output for s in good) / wall_s, None, None, ttft)


async def run_router(name: str, n_workers: int, trace: list[TraceRequest], scale: float, max_output: int,
                     run_dir: Path) -> Row:
    engines = EngineSet(run_dir=run_dir / name.replace(" ", "_"))
    model_dir = ensure_tiny_model()
    sims: list[tuple[str, int, int]] = []
    try:
        procs = []
        ports = free_ports(3 * n_workers + 2)
        for i in range(n_workers):
            port, ev, rep = ports[3 * i : 3 * i + 3]
            env = {"KVGATE_SIM_PROFILE": "dynamo-mocker", "KVGATE_SIM_MAX_MODEL_LEN": "131072",
                   "KVGATE_SIM_HASH_SEED": "0", "KVGATE_SIM_MODEL_DIR": str(model_dir),
                   "KVGATE_SIM_KV_EVENTS_ENDPOINT": f"tcp://127.0.0.1:{ev}",
                   "KVGATE_SIM_KV_REPLAY_ENDPOINT": f"tcp://127.0.0.1:{rep}"}
            p = spawn(f"sim-{port}", [_python(), "-m", "kvgate.cli", "--log-level", "WARNING", "sim", "--port",
                                        str(port)], env, engines.run_dir)
            p.url = f"http://127.0.0.1:{port}"
            engines.procs.append(p)
            procs.append(p)
            sims.append((p.url, ev, rep))
        for p in procs:
            wait_http(p, p.url + "/health", 60)
        urls = [u for u, _, _ in sims]
        port = ports[-2]
        if name.startswith("kvgate"):
            workers = [{"url": u, "model": MODEL, "engine": "sim", "block_size": 64, "kv_events": "auto"} for u in urls]
            env = {"KVGATE_WORKERS": json.dumps(workers), "KVGATE_TOKENIZERS": json.dumps({MODEL: str(model_dir)}),
                   "KVGATE_HASH_SEED": "0", "KVGATE_HEALTH_INTERVAL_S": "1"}
            gw: Proc = spawn(f"kvgate-{port}", [_python(), "-m", "kvgate.cli", "--log-level", "WARNING", "serve",
                                                 "--port", str(port)], env, engines.run_dir)
            gw.url = f"http://127.0.0.1:{port}"
            engines.procs.append(gw)
            wait_http(gw, gw.url + "/ready", 60)
        else:
            router, policy = name.split(" ", 1)
            ensure_router(router)
            engines.start_router(router, ["--worker-urls", *urls, "--policy", policy, "--prometheus-port",
                                          str(ports[-1])], port)
        url = f"http://127.0.0.1:{port}"
        await _wait_routable(url)
        samples, wall = await replay(url, trace, scale, max_output)
        return _row(name, samples, wall)
    finally:
        engines.stop()


def _python() -> str:
    import sys

    return sys.executable


async def _wait_routable(url: str, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=30) as c:
        while time.monotonic() < deadline:
            try:
                r = await c.post(url + "/v1/completions", json={"model": MODEL, "prompt": "warm up", "max_tokens": 1})
                if r.status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(1)
    raise TimeoutError(f"{url} never became routable")


def run(trace_path: Path, n_requests: int = 300, compress: float = 2.0, n_workers: int = 4, scale: float = 0.25,
        max_output: int = 64, run_dir: Path = Path("bench-out/peers")) -> list[Row]:
    trace = load_mooncake(trace_path, n_requests, compress)
    rows = []
    for name in ("kvgate cost_model", "sglang-router cache_aware", "vllm-router cache_aware",
                 "vllm-router consistent_hash"):
        t0 = time.perf_counter()
        rows.append(asyncio.run(run_router(name, n_workers, trace, scale, max_output, run_dir)))
        print(f"  peers: {name} done in {time.perf_counter() - t0:.0f}s", flush=True)
    return rows
