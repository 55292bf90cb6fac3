"""``kvgate bench tenants``: what a heavy tenant does to a light one's time to first token, with admission
off and on.

Three simulated vLLM workers with four sequence slots each (``max_num_seqs=4``) behind one gateway. A
light tenant sends streamed chat requests at ``light_rps`` (Poisson arrivals, open loop), first alone
(solo), then beside a heavy tenant sending the same kind of request at ten times its rate: once with
admission off, once with it on (both tenants under the same default limits: ``max_concurrent`` of the
fleet's 12 slots, ``worker_slots=4``, the fair queue). Each phase runs on fresh workers and a fresh
gateway; a phase ends when every light request it started has finished (heavy requests still running
are left to finish too, so the light tenant's last requests see the backlog the heavy one built).

The full run adds a row (``EXTRA``). Reported: the light tenant's
TTFT p50 and p99 (as its client sees it: queueing in the gateway and in the
engine included) and their ratio to solo, and the heavy tenant's 429 and 503 answers. Clients do not
retry. All in one process (gateway, workers, clients), so the machine's CPU is shared by all three.
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
from typing import Any

import httpx

from kvgate.bench.stores import pct
from kvgate.config import GatewaySettings, WorkerConfig
from kvgate.gateway.app import create_app, make_client
from kvgate.serving import ServerHandle, start_server
from kvgate.sim.server import SimWorker
from kvgate.sim.settings import SimSettings
from kvgate.tokens.tinymodel import ensure_tiny_model

MODEL = "kvgate-tiny"
WORKERS = 3
SLOTS = 4
REQUEST_TIMEOUT_S = 120.0
"""A request without an answer this long counts as failed (status 0 in the tallies)."""
HEAVY_DRAIN_S = 60.0


@dataclass(frozen=True)
class Params:
    seconds: float = 40.0
    light_rps: float = 2.0
    heavy_factor: float = 10.0
    prompt_words: int = 100
    """~300 prompt tokens of the tiny model's tokenizer; each request's text is its own (no shared prefix)."""
    output_tokens: int = 24
    speed: float = 0.25
    """The h100-llama3-8b timing profile run 4× slower: ~130 ms to prefill a prompt, ~28 ms a decode step,
    so a request holds a slot ~0.8 s and the workers' time dominates the gateway's."""
    max_concurrent: int = 8
    """Every tenant's limit (admission on), of the fleet's 12 slots."""
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
    """The machine's 1-minute load average at the phase's end: the workers' timing is simulated on this
    machine's CPU, so a busy machine shows in every row."""


@dataclass(frozen=True)
class PhaseSpec:
    name: str
    heavy: bool = False
    admission: bool = False
    max_concurrent: int | None = None
    """Every tenant's limit; None: ``Params.max_concurrent``."""
    heavy_batch: bool = False
    """The heavy tenant's requests say ``x-kvgate-priority: batch``, and the class goes to the workers as vLLM's
    ``priority`` (``worker_priority``; the simulated workers run priority scheduling)."""


async def _request(http: httpx.AsyncClient, url: str, tenant: str, rng: random.Random, p: Params, tally: Tally,
                   batch: bool) -> None:
    words = " ".join(f"w{rng.randrange(1_000_000)}" for _ in range(p.prompt_words // 2))
    body = {"model": MODEL, "stream": True, "max_tokens": p.output_tokens,
            "messages": [{"role": "user", "content": words}],
            "sim": {"reasoning_tokens": 0, "answer_tokens": p.output_tokens, "tool_calls": 0}}
    t0 = time.perf_counter()
    try:
        async with http.stream("POST", url + "/v1/chat/completions", json=body,
                               headers={"x-tenant-id": tenant, "x-conversation-id": uuid.uuid4().hex,
                                        "x-kvgate-priority": "batch" if batch else "interactive"}) as r:
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
                  tasks: list[asyncio.Task[None]], batch: bool = False) -> None:
    """Poisson arrivals for ``p.seconds``; each request its own task (open loop)."""
    rng = random.Random(seed)
    end = time.monotonic() + p.seconds
    while True:
        await asyncio.sleep(rng.expovariate(rps))
        if time.monotonic() >= end:
            return
        tasks.append(asyncio.create_task(_request(http, url, tenant, rng, p, tally, batch)))


async def _cluster(p: Params, spec: PhaseSpec) -> tuple[list[ServerHandle], ServerHandle]:
    model_dir = ensure_tiny_model()
    sims = []
    for _ in range(WORKERS):
        w = SimWorker(SimSettings(model_dir=str(model_dir), profile="h100-llama3-8b", hash_seed="0", speed=p.speed,
                                  max_num_seqs=SLOTS, priority_scheduling=spec.heavy_batch))
        sims.append(await start_server(w.build_app()))
    adm: dict[str, Any] = {"enabled": spec.admission, "worker_slots": SLOTS, "queue_size": p.queue_size,
                           "max_queue_wait_s": p.max_queue_wait_s, "worker_priority": spec.heavy_batch,
                           "defaults": {"max_concurrent": spec.max_concurrent or p.max_concurrent}}
    gw = await start_server(create_app(GatewaySettings(
        workers=[WorkerConfig(url=s.url, model=MODEL, engine="sim", block_size=16) for s in sims],
        tokenizers={MODEL: str(model_dir)}, hash_seed="0", admission=adm, health_interval_s=1.0)))
    return sims, gw


async def phase(spec: PhaseSpec, p: Params, seed: int) -> Phase:
    sims, gw = await _cluster(p, spec)
    light, heavy_t = Tally(), Tally() if spec.heavy else None
    light_tasks: list[asyncio.Task[None]] = []
    heavy_tasks: list[asyncio.Task[None]] = []
    try:
        async with make_client(httpx.Timeout(REQUEST_TIMEOUT_S)) as http:
            senders = [_tenant(http, gw.url, "light", p.light_rps, p, seed, light, light_tasks)]
            if heavy_t is not None:
                senders.append(_tenant(http, gw.url, "heavy", p.light_rps * p.heavy_factor, p, seed + 1, heavy_t,
                                       heavy_tasks, spec.heavy_batch))
            await asyncio.gather(*senders)
            await asyncio.gather(*light_tasks)
            # The light tenant is measured; the heavy one's stragglers get a while, then their clients leave.
            _, late = await asyncio.wait(heavy_tasks, timeout=HEAVY_DRAIN_S) if heavy_tasks else (set(), set())
            for t in late:
                t.cancel()
            await asyncio.gather(*late, return_exceptions=True)
    finally:
        await gw.stop()
        for s in sims:
            await s.stop()
    return Phase(spec.name, light, heavy_t, os.getloadavg()[0])


def table(by_seed: dict[int, list[Phase]], p: Params) -> str:
    lines = [f"light tenant {p.light_rps:g} req/s, heavy {p.light_rps * p.heavy_factor:g} req/s; {WORKERS} simulated "
             f"workers x {SLOTS} slots; {p.seconds:g} s per phase; max_concurrent {p.max_concurrent} per tenant "
             "(admission on, unless the phase says otherwise)", "",
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


PHASES = (PhaseSpec("solo"), PhaseSpec("with heavy, admission off", heavy=True),
          PhaseSpec("with heavy, admission on", heavy=True, admission=True))
EXTRA = (PhaseSpec("with heavy, admission on, max_concurrent 6", heavy=True, admission=True, max_concurrent=6),)
"""The full run's extra row: the limit at half the fleet's slots (the light tenant shares the engines' steps
with what the heavy one runs). ``heavy_batch`` is not run by default: the simulator's priority model is the
one of kvgate's background prefills, where a waiting higher-priority request does not preempt running
lower-priority ones, so a worker whose four sequences are all batch requests holds an interactive request
until its client gives up (vLLM's priority scheduler preempts instead)."""


async def measure(p: Params, seeds: list[int], phases: tuple[PhaseSpec, ...] = PHASES) -> dict[int, list[Phase]]:
    out: dict[int, list[Phase]] = {}
    for seed in seeds:
        out[seed] = []
        for spec in phases:
            t0 = time.monotonic()
            out[seed].append(await phase(spec, p, seed))
            print(f"seed {seed}: {spec.name}: {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
    return out


def run(quick: bool = False, seeds: list[int] | None = None) -> str:
    p = Params(seconds=5.0) if quick else Params()
    phases = PHASES if quick else PHASES + EXTRA
    text = table(asyncio.run(measure(p, seeds or ([1] if quick else [1, 2]), phases)), p)
    print(text)
    return text
