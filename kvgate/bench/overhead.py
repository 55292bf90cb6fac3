"""``kvgate bench overhead``: what the gateway adds to a request, against a direct connection to a worker.

Two identical simulated workers run as processes; the gateway runs as a process in front of the first,
pinned to one core (``taskset``, when the machine has it), the way a deployment gives it a CPU. Each
request of an open-loop Poisson stream is sent twice at the same instant, byte for byte the same: to the
gateway (which forwards it to worker 1) and straight to worker 2. The requests are turns of agent
conversations that grow to ~9k tokens (streamed, usage on), so the gateway does all of its per-request
work: conversation record, canonical history, incremental tokenization and hashing, routing, the SSE
relay, the record of the turn. Reported per arrival rate: time to first token and inter-token latency
through the gateway and direct (p50 / p99), the added time (the difference of the paired requests), and
the highest rate one gateway core sustains (added p99 TTFT under 3 ms).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvgate.bench.report import pct
from kvgate.serving import free_port
from kvgate.tokens.tinymodel import ensure_tiny_model

MODEL = "kvgate-tiny"
WORDS = ("agent tool result file test error fix patch diff line module import class function value "
         "request cache worker block token prefix").split()


@dataclass
class Sample:
    ttft_gw: float
    ttft_direct: float
    itl_gw: list[float] = field(default_factory=list)
    itl_direct: list[float] = field(default_factory=list)


class _Conversations:
    """Agent conversations as a client keeps them: each next turn sends the whole history with the
    answer the gateway gave to the previous one, so the gateway sees what it recorded (no loss, no edits).
    An arrival goes to a conversation that is not waiting for an answer, or starts a new one."""

    def __init__(self, rate: float, n_turns: int, seed: int) -> None:
        self.rng = random.Random(seed)
        self.rate, self.n_turns = rate, n_turns
        self.idle: list[tuple[str, list[dict[str, Any]]]] = []
        self.started = 0

    def take(self) -> tuple[str, list[dict[str, Any]]]:
        if self.idle:
            conv, msgs = self.idle.pop(self.rng.randrange(len(self.idle)))
        else:
            conv = f"c{self.started}-{self.rate:g}"
            self.started += 1
            msgs = [{"role": "system", "content": f"You are agent {conv}. " + "Be careful. " * 60}]
        turn = sum(m["role"] == "user" for m in msgs)
        words = " ".join(self.rng.choice(WORDS) for _ in range(110))
        return conv, [*msgs, {"role": "user", "content": f"step {turn}: {words}"}]

    def answered(self, conv: str, msgs: list[dict[str, Any]], answer: str) -> None:
        if sum(m["role"] == "user" for m in msgs) < self.n_turns:
            self.idle.append((conv, [*msgs, {"role": "assistant", "content": answer}]))


async def _stream(h: httpx.AsyncClient, url: str, body: dict[str, Any], conv: str, keep: bool = False
                  ) -> tuple[float, list[float], str]:
    t0 = time.perf_counter()
    first: float | None = None
    last = t0
    gaps: list[float] = []
    text: list[str] = []
    async with h.stream("POST", url + "/v1/chat/completions", json=body, headers={"x-conversation-id": conv}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url} answered {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            now = time.perf_counter()
            if first is None:
                if '"content"' in line or '"reasoning"' in line:
                    first = now
            else:
                gaps.append((now - last) * 1000)
            last = now
            for ch in json.loads(line[6:]).get("choices") or () if keep else ():
                text.append((ch.get("delta") or {}).get("content") or "")
    return ((first or last) - t0) * 1000, gaps, "".join(text)


async def _pair(h: httpx.AsyncClient, gw: str, direct: str, convs: _Conversations) -> Sample:
    conv, msgs = convs.take()
    body = {"model": MODEL, "messages": msgs, "stream": True, "stream_options": {"include_usage": True},
            "max_tokens": 16, "sim": {"reasoning_tokens": 0, "answer_tokens": 16}}
    (tg, ig, answer), (td, id_, _) = await asyncio.gather(_stream(h, gw, body, conv, keep=True),
                                                          _stream(h, direct, body, conv))
    convs.answered(conv, msgs, answer)
    return Sample(tg, td, ig, id_)


async def _run_rate(gw: str, direct: str, rate: float, seconds: float, n_turns: int) -> list[Sample]:
    rng = random.Random(int(rate))
    convs = _Conversations(rate, n_turns, int(rate) + 1)
    samples: list[Sample] = []
    tasks: list[asyncio.Task[Sample]] = []
    limits = httpx.Limits(max_connections=4000, max_keepalive_connections=400)
    async with httpx.AsyncClient(timeout=120, limits=limits) as h:
        t_end = time.perf_counter() + seconds
        while time.perf_counter() < t_end:
            tasks.append(asyncio.create_task(_pair(h, gw, direct, convs)))
            await asyncio.sleep(rng.expovariate(rate))
        for t in tasks:
            try:
                samples.append(await t)
            except (httpx.HTTPError, RuntimeError) as exc:
                print(f"  request failed: {exc!r}", file=sys.stderr)
    return samples


ROUTERS = ("kvgate", "kvgate (aiohttp upstream)", "sglang-router cache_aware", "vllm-router cache_aware")


def _spawn(cmd: list[str], core: str | None, log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    if core is not None and shutil.which("taskset"):
        cmd = ["taskset", "-c", core, *cmd]
    with open(log, "wb") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONHASHSEED": "0", **env}, start_new_session=True)


def _router_cmd(name: str, port: int, workers: Sequence[str]) -> tuple[list[str], str]:
    """The command line and the readiness path of one router in front of ``workers``."""
    if name.startswith("kvgate"):
        return [sys.executable, "-m", "kvgate.cli", "--log-level", "WARNING", "serve", "--port", str(port),
                *(a for w in workers for a in ("--worker", f"{w}={MODEL}@sim"))], "/ready"
    router, policy = name.split(" ", 1)
    from kvgate.dev.engines import engines_dir, ensure_router

    ensure_router(router)
    venv = engines_dir() / f"venv-{router}"
    head = ([str(venv / "bin" / "python"), "-m", "sglang_router.launch_router"] if router == "sglang-router"
            else [str(venv / "bin" / "vllm-router")])
    return [*head, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *workers, "--policy", policy,
            "--prometheus-port", str(free_port())], "/health"


def upstream_client(name: str) -> str:
    """kvgate's upstream client for a row named "kvgate (httpx upstream)" or "(aiohttp upstream)"."""
    return next((c for c in ("httpx", "aiohttp") if f"({c} upstream)" in name), "httptools")


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process and its threads (children a router forks included)."""
    total = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    for p in [pid, *_children(pid)]:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / tick
    return total


def _children(pid: int) -> list[int]:
    try:
        kids = [int(c) for t in Path(f"/proc/{pid}/task").iterdir()
                for c in (t / "children").read_text().split()]
    except OSError:
        return []
    return kids + [g for k in kids for g in _children(k)]


async def _ready(url: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient() as h:
        while time.monotonic() < deadline:
            try:
                if (await h.get(url)).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.2)
    raise TimeoutError(url)


@dataclass
class RateResult:
    samples: list[Sample]
    cpu_ms_per_request: float


def table(results: dict[str, dict[float, RateResult]]) -> str:
    lines = ["| router | rate (req/s) | requests | TTFT via router p50 / p99 (ms) | direct p50 / p99 | added TTFT "
             "p50 / p99 (paired) | ITL via router p50 / p99 | direct p50 / p99 | router CPU per request (ms) | "
             "requests/s at one full core |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, by_rate in results.items():
        for rate, rr in by_rate.items():
            ss = rr.samples
            if not ss:
                lines.append(f"| {name} | {rate:g} | 0 | | | | | | | |")
                continue
            g, d = [s.ttft_gw for s in ss], [s.ttft_direct for s in ss]
            added = [s.ttft_gw - s.ttft_direct for s in ss]
            ig = [x for s in ss for x in s.itl_gw]
            id_ = [x for s in ss for x in s.itl_direct]
            cpu = rr.cpu_ms_per_request
            lines.append(f"| {name} | {rate:g} | {len(ss)} | {pct(g, .5):.1f} / {pct(g, .99):.1f} | "
                         f"{pct(d, .5):.1f} / {pct(d, .99):.1f} | {pct(added, .5):+.2f} / {pct(added, .99):+.2f} | "
                         f"{pct(ig, .5):.2f} / {pct(ig, .99):.2f} | {pct(id_, .5):.2f} / {pct(id_, .99):.2f} | "
                         f"{cpu:.2f} | {1000 / cpu if cpu > 0 else float('inf'):.0f} |")
    return "\n".join(lines) + "\n"


async def measure_router(name: str, rates: tuple[float, ...], seconds: float, out: Path) -> dict[float, RateResult]:
    """Fresh workers for each router, so none inherits another's cache."""
    model = ensure_tiny_model()
    p1, p2, pg = free_port(), free_port(), free_port()
    # Four times an H100's speed: the engines must not be what limits the rate (at 1x, 50 turns/s of
    # ~250 new tokens each already fill the modelled engine and inter-token gaps reach 0.7 s).
    sim = [sys.executable, "-m", "kvgate.cli", "--log-level", "WARNING", "sim", "--model-dir", str(model),
           "--profile", "h100-llama3-8b", "--block-size", "16", "--speed", "4"]
    client = upstream_client(name)
    tag = name.split()[0] + ("" if client == "httptools" else f"-{client}")
    env = {"KVGATE_TOKENIZERS": json.dumps({MODEL: str(model)}), "KVGATE_SIM_MAX_MODEL_LEN": "131072",
           "KVGATE_UPSTREAM_CLIENT": upstream_client(name)}
    procs = [_spawn([*sim, "--port", str(p)], "1", out / f"overhead-{tag}-sim{i}.log", env)
             for i, p in enumerate((p1, p2))]
    w1, w2, gw = f"http://127.0.0.1:{p1}", f"http://127.0.0.1:{p2}", f"http://127.0.0.1:{pg}"
    cmd, ready = _router_cmd(name, pg, [w1])
    router = _spawn(cmd, "0", out / f"overhead-{tag}.log", env)
    procs.append(router)
    try:
        for u in (w1 + "/health", w2 + "/health", gw + ready):
            await _ready(u)
        print(f"  {name}: pid {router.pid} (to profile: py-spy record --gil -p {router.pid})", file=sys.stderr)
        results = {}
        for rate in rates:
            c0 = _cpu_s(router.pid)
            ss = await _run_rate(gw, w2, rate, seconds, n_turns=40)
            results[rate] = RateResult(ss, (_cpu_s(router.pid) - c0) * 1000 / max(1, len(ss)))
            print(f"  {name} at {rate:g}/s: {len(ss)} requests", file=sys.stderr)
        return results
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=20)


def run(out: Path = Path("bench-out"), quick: bool = False, routers: tuple[str, ...] = ROUTERS) -> str:
    out.mkdir(parents=True, exist_ok=True)
    rates = (10, 50) if quick else (10, 50, 100)
    results = {name: asyncio.run(measure_router(name, rates, 8.0 if quick else 15.0, out)) for name in routers}
    cores = "core 0" if shutil.which("taskset") else "any core (no taskset)"
    text = (f"# kvgate bench overhead\n\nEach router pinned to {cores}, the two workers and the client on core 1; "
            "each request sent at the same instant to the router (in front of worker 1) and straight to worker 2. "
            "Percentiles as Dynamo computes them.\n\n" + table(results))
    write_section(out / "overhead.md", "paired", text)
    print(text)
    return text


def write_section(path: Path, name: str, text: str) -> None:
    """Put ``text`` in ``path`` as section ``name``, keeping the other sections: the paired-client run and
    the load-generator run (``kvgate.bench.loadgen``) are separate commands writing one report."""
    start, end = f"<!-- section:{name} -->\n", f"<!-- /section:{name} -->\n"
    old = path.read_text() if path.exists() else ""
    block = start + text.rstrip("\n") + "\n" + end
    if start in old and end in old:
        head, rest = old.split(start, 1)
        new = head + block + rest.split(end, 1)[1]
    else:
        new = old + ("\n" if old else "") + block
    path.write_text(new)
