"""The real-process part of ``kvgate bench tenants``: the same question as the virtual-time part
(``tenants.py``), asked of the whole gateway over HTTP.

Three simulated vLLM workers (``kvgate sim`` processes, the h100-llama3-8b timing run ``slowdown`` times
slower, ``max_num_seqs`` slots each, KV events on) behind one ``kvgate serve`` process; the clients run in
this process. A light tenant sends streamed chat requests at ``light_rps`` (Poisson, open loop, no
retries), first alone (solo), then beside a heavy tenant at ``heavy_factor`` times its rate, with
admission off and on. Each phase gets fresh processes. A phase ends when every light request it started
has finished; heavy requests still running then get ``HEAVY_DRAIN_S`` more, then their clients leave.

TTFT is the client's: from sending the request to the first content token of the stream (the simulated
model answers with an empty reasoning block first, so this includes a few decode steps after the
prefill). On 2 cores the gateway, the workers' simulation and the clients share the CPU: the ``load``
column is the 1-minute load average at each phase's end.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvgate.bench.report import pct
from kvgate.dev.engines import EngineSet, Proc, free_ports, spawn, wait_http
from kvgate.tokens.tinymodel import WORDS, ensure_tiny_model

MODEL = "kvgate-tiny"
WORKERS = 3
REQUEST_TIMEOUT_S = 120.0
"""A request without an answer this long counts as failed (status 0 in the tallies)."""
HEAVY_DRAIN_S = 60.0


@dataclass(frozen=True)
class Params:
    seconds: float = 40.0
    light_rps: float = 2.0
    heavy_factor: float = 10.0
    prompt_tokens: int = 300
    """Each request's own text (no prefix shared with others): words of the tiny model's vocabulary, one
    token each."""
    output_tokens: int = 24
    slots: int = 4
    slowdown: float = 4.0
    """The h100-llama3-8b timing run this many times slower (a 300-token prefill ~130 ms, a decode step
    ~28 ms), so the workers' time dominates the gateway's on this machine."""
    max_concurrent: int = 8
    """Every tenant's limit (admission on)."""
    queue_size: int = 64
    max_queue_wait_s: float = 5.0


@dataclass
class Tally:
    ttft_ms: list[float] = field(default_factory=list)
    status: dict[int, int] = field(default_factory=dict)

    def count(self, code: int) -> None:
        self.status[code] = self.status.get(code, 0) + 1


@dataclass
class Phase:
    name: str
    light: Tally
    heavy: Tally | None
    load: float = 0.0


@dataclass(frozen=True)
class PhaseSpec:
    name: str
    heavy: bool = False
    admission: bool = False
    extra: tuple[tuple[str, Any], ...] = ()
    """Admission settings beside the bench's (``fair_share``, ``worker_slots``, tenants' weights)."""


async def _request(http: httpx.AsyncClient, url: str, tenant: str, rng: random.Random, p: Params,
                   tally: Tally) -> None:
    words = " ".join(rng.choice(WORDS) for _ in range(p.prompt_tokens - 8))  # the template adds ~8
    body = {"model": MODEL, "stream": True, "max_tokens": p.output_tokens,
            "messages": [{"role": "user", "content": words}],
            "sim": {"reasoning_tokens": 0, "answer_tokens": p.output_tokens, "tool_calls": 0}}
    t0 = time.perf_counter()
    try:
        async with http.stream("POST", url + "/v1/chat/completions", json=body,
                               headers={"x-tenant-id": tenant, "x-conversation-id": uuid.uuid4().hex}) as r:
            tally.count(r.status_code)
            if r.status_code != 200:
                await r.aread()
                return
            ttft = None
            async for line in r.aiter_lines():
                if ttft is None and line.startswith("data: {"):
                    obj = json.loads(line[6:])
                    if any((c.get("delta") or {}).get("content") for c in obj.get("choices", [])):
                        ttft = time.perf_counter() - t0
            if ttft is not None:
                tally.ttft_ms.append(ttft * 1000)
    except httpx.HTTPError:
        tally.count(0)


async def _tenant(http: httpx.AsyncClient, url: str, tenant: str, rps: float, p: Params, seed: int, tally: Tally,
                  tasks: list[asyncio.Task[None]]) -> None:
    """Poisson arrivals for ``p.seconds``; each request its own task (open loop)."""
    rng = random.Random(seed)
    end = time.monotonic() + p.seconds
    while True:
        await asyncio.sleep(rng.expovariate(rps))
        if time.monotonic() >= end:
            return
        tasks.append(asyncio.create_task(_request(http, url, tenant, rng, p, tally)))


def _cluster(p: Params, spec: PhaseSpec, run_dir: Path) -> tuple[EngineSet, str]:
    model_dir = ensure_tiny_model()
    engines = EngineSet(run_dir=run_dir)
    ports = free_ports(3 * WORKERS + 1)
    workers = []
    for i in range(WORKERS):
        port, ev, rep = ports[3 * i : 3 * i + 3]
        env = {"KVGATE_SIM_PROFILE": "h100-llama3-8b", "KVGATE_SIM_SPEED": str(1 / p.slowdown),
               "KVGATE_SIM_MAX_NUM_SEQS": str(p.slots), "KVGATE_SIM_HASH_SEED": "0",
               "KVGATE_SIM_MODEL_DIR": str(model_dir), "KVGATE_SIM_KV_EVENTS_ENDPOINT": f"tcp://127.0.0.1:{ev}",
               "KVGATE_SIM_KV_REPLAY_ENDPOINT": f"tcp://127.0.0.1:{rep}"}
        proc = spawn(f"sim-{port}", [sys.executable, "-m", "kvgate.cli", "--log-level", "WARNING", "sim", "--port",
                                     str(port)], env, engines.run_dir)
        proc.url = f"http://127.0.0.1:{port}"
        engines.procs.append(proc)
        workers.append({"url": proc.url, "model": MODEL, "engine": "sim", "block_size": 16, "kv_events": "auto"})
    for proc in engines.procs:
        wait_http(proc, proc.url + "/health", 60)
    adm: dict[str, Any] = {"enabled": spec.admission, "worker_slots": p.slots, "queue_size": p.queue_size,
                           "max_queue_wait_s": p.max_queue_wait_s,
                           "defaults": {"max_concurrent": p.max_concurrent}, **dict(spec.extra)}
    env = {"KVGATE_WORKERS": json.dumps(workers), "KVGATE_TOKENIZERS": json.dumps({MODEL: str(model_dir)}),
           "KVGATE_HASH_SEED": "0", "KVGATE_HEALTH_INTERVAL_S": "1", "KVGATE_ADMISSION": json.dumps(adm)}
    port = ports[-1]
    gw: Proc = spawn(f"kvgate-{port}", [sys.executable, "-m", "kvgate.cli", "--log-level", "WARNING", "serve",
                                        "--port", str(port)], env, engines.run_dir)
    gw.url = f"http://127.0.0.1:{port}"
    engines.procs.append(gw)
    wait_http(gw, gw.url + "/ready", 60)
    return engines, gw.url


async def phase(spec: PhaseSpec, p: Params, seed: int, run_dir: Path) -> Phase:
    engines, url = await asyncio.to_thread(_cluster, p, spec, run_dir / f"{seed}-{spec.name.replace(' ', '_')}")
    light, heavy_t = Tally(), Tally() if spec.heavy else None
    light_tasks: list[asyncio.Task[None]] = []
    heavy_tasks: list[asyncio.Task[None]] = []
    limits = httpx.Limits(max_connections=2000, max_keepalive_connections=200)
    try:
        async with httpx.AsyncClient(timeout=httpx.Timeout(REQUEST_TIMEOUT_S), limits=limits) as http:
            senders = [_tenant(http, url, "light", p.light_rps, p, seed, light, light_tasks)]
            if heavy_t is not None:
                senders.append(_tenant(http, url, "heavy", p.light_rps * p.heavy_factor, p, seed + 1000, heavy_t,
                                       heavy_tasks))
            await asyncio.gather(*senders)
            await asyncio.gather(*light_tasks)
            _, late = await asyncio.wait(heavy_tasks, timeout=HEAVY_DRAIN_S) if heavy_tasks else (set(), set())
            for t in late:
                t.cancel()
            await asyncio.gather(*late, return_exceptions=True)
    finally:
        await asyncio.to_thread(engines.stop)
    return Phase(spec.name, light, heavy_t, os.getloadavg()[0])


PHASES = (PhaseSpec("solo", admission=True), PhaseSpec("with heavy, admission off", heavy=True),
          PhaseSpec("with heavy, admission on, fair share off", heavy=True, admission=True,
                    extra=(("fair_share", False),)),
          PhaseSpec("with heavy, admission on", heavy=True, admission=True))


def table(by_seed: dict[int, list[Phase]], p: Params) -> str:
    lines = [f"Real processes: light tenant {p.light_rps:g} req/s, heavy {p.light_rps * p.heavy_factor:g} req/s; "
             f"{WORKERS} kvgate sim workers x {p.slots} slots; {p.prompt_tokens}-token prompts, {p.output_tokens} "
             f"output tokens; {p.seconds:g} s per phase; max_concurrent {p.max_concurrent} per tenant", "",
             "| seed | phase | light n | light TTFT p50 (ms) | p99 (ms) | p50 / solo | p99 / solo | "
             "heavy 200 | heavy 429 | heavy 503 | light non-200 (status x n; 0: no answer) | load |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for seed, phases in by_seed.items():
        solo = phases[0].light.ttft_ms
        s50, s99 = pct(solo, .5), pct(solo, .99)
        for ph in phases:
            t = ph.light.ttft_ms
            p50, p99 = pct(t, .5), pct(t, .99)
            h = ph.heavy.status if ph.heavy is not None else {}
            other = " ".join(f"{code}x{n}" for code, n in sorted(ph.light.status.items()) if code != 200) or "0"
            heavy = (str(h.get(200, 0)), str(h.get(429, 0)), str(h.get(503, 0))) if ph.heavy else ("-",) * 3
            cells = [str(seed), ph.name, str(len(t)), f"{p50:.0f}", f"{p99:.0f}", f"{p50 / s50:.2f}",
                     f"{p99 / s99:.2f}", *heavy, other, f"{ph.load:.1f}"]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


async def measure(p: Params, seeds: list[int], phases: tuple[PhaseSpec, ...], run_dir: Path
                  ) -> dict[int, list[Phase]]:
    out: dict[int, list[Phase]] = {}
    for seed in seeds:
        out[seed] = []
        for spec in phases:
            t0 = time.monotonic()
            out[seed].append(await phase(spec, p, seed, run_dir))
            print(f"seed {seed}: {spec.name}: {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
    return out


def run(p: Params, seeds: list[int], phases: tuple[PhaseSpec, ...] = PHASES,
        run_dir: Path = Path("bench-out/tenants")) -> str:
    return table(asyncio.run(measure(p, seeds, phases, run_dir)), p)
