"""``kvgate bench hostile``: what one big prompt does to everybody else's requests, through a ``kvgate serve``
process as deployed (one simulated worker behind it; this process is the clients).

While a prompt of each shape and size is sent (five times each), a second client polls ``/health`` every
5 ms from another thread; the table gives the gateway's answer to the prompt, how long it took, and the
``/health`` latencies during it against those just before (the issue's target: no more than 100 ms of
delay), and the gateway's resident memory before and after (nothing is kept for a refused prompt).
"""

from __future__ import annotations

import json
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

from kvgate.bench.report import pct
from kvgate.dev.engines import EngineSet, free_ports, spawn, wait_http
from kvgate.tokens.tinymodel import ensure_tiny_model

MODEL = "kvgate-tiny"
SHAPES = ("many messages", "one message")
SIZES_MB = (0.5, 2.0, 7.0)
REPEAT = 5


def body(shape: str, n_bytes: int) -> bytes:
    if shape == "many messages":  # what cost the event loop most before: rendered and tokenized whole
        msgs = [{"role": ("user", "assistant")[i % 2], "content": "word " * 20} for i in range(n_bytes // 100)]
    else:
        msgs = [{"role": "user", "content": "word " * (n_bytes // 5)}]
    return json.dumps({"model": MODEL, "max_tokens": 4, "messages": msgs}).encode()


class Probe:
    """``/health`` every 5 ms from its own thread and connection."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.samples: list[tuple[float, float]] = []  # (sent at, latency) in perf_counter seconds
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=60) as h:
            while not self._stop.is_set():
                t = time.perf_counter()
                h.get("/health")
                self.samples.append((t, time.perf_counter() - t))
                time.sleep(0.005)

    def between(self, a: float, b: float) -> list[float]:
        return [lat * 1000 for t, lat in self.samples if a <= t <= b or (t < a < t + lat)]

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def run(run_dir: Path = Path("bench-out/hostile")) -> str:
    model_dir = ensure_tiny_model()
    engines = EngineSet(run_dir=run_dir)
    sim_port, gw_port = free_ports(2)
    try:
        sim = spawn("sim", [sys.executable, "-m", "kvgate.cli", "--log-level", "WARNING", "sim", "--port",
                            str(sim_port)], {"KVGATE_SIM_MODEL_DIR": str(model_dir)}, engines.run_dir)
        sim.url = f"http://127.0.0.1:{sim_port}"
        engines.procs.append(sim)
        wait_http(sim, sim.url + "/health", 60)
        env = {"KVGATE_WORKERS": json.dumps([{"url": sim.url, "model": MODEL, "engine": "sim"}]),
               "KVGATE_TOKENIZERS": json.dumps({MODEL: str(model_dir)})}
        gw = spawn("kvgate", [sys.executable, "-m", "kvgate.cli", "--log-level", "WARNING", "serve", "--port",
                              str(gw_port)], env, engines.run_dir)
        gw.url = f"http://127.0.0.1:{gw_port}"
        engines.procs.append(gw)
        wait_http(gw, gw.url + "/ready", 60)
        return _measure(gw.url, gw.pid)
    finally:
        engines.stop()


def _measure(url: str, pid: int) -> str:
    lines = ["/health through a `kvgate serve` process while one big prompt is handled (5 each; the worker's "
             "context is 4,096 tokens)", "",
             "| prompt | size | answer | request ms (max) | /health before p50 / max (ms) | /health during "
             "p50 / max (ms) | delay over before's p50, worst (ms) | RSS before → after (MB) |",
             "|---|---|---|---|---|---|---|---|"]
    probe = Probe(url)
    try:
        with httpx.Client(base_url=url, timeout=120) as h:
            h.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 2,
                                                 "messages": [{"role": "user", "content": "warm up"}]})
            for shape in SHAPES:
                for mb in SIZES_MB:
                    lines.append(_row(h, probe, pid, shape, mb))
    finally:
        probe.stop()
    return "\n".join(lines)


def _row(h: httpx.Client, probe: Probe, pid: int, shape: str, mb: float) -> str:
    data = body(shape, int(mb * 1_000_000))
    rss0 = rss_mb(pid)
    before: list[float] = []
    during: list[float] = []
    took: list[float] = []
    answers: set[str] = set()
    for _ in range(REPEAT):
        t0 = time.perf_counter()
        time.sleep(0.3)
        t1 = time.perf_counter()
        r = h.post("/v1/chat/completions", content=data, headers={"content-type": "application/json"})
        t2 = time.perf_counter()
        time.sleep(0.05)  # the last /health sent during the request comes back
        before += probe.between(t0, t1)
        during += probe.between(t1, t2)
        took.append((t2 - t1) * 1000)
        err = r.json().get("error", {}) if r.headers.get("content-type", "").startswith("application/json") else {}
        answers.add(f"{r.status_code} {err.get('code', '')}".strip())
    base = statistics.median(before)
    return (f"| {shape} | {mb:g} MB | {', '.join(sorted(answers))} | {max(took):.0f} | {base:.1f} / "
            f"{max(before):.1f} | {pct(during, .5):.1f} / {max(during):.1f} | {max(during) - base:.1f} | "
            f"{rss0:.0f} → {rss_mb(pid):.0f} |")
