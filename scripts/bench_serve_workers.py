"""Sustained request rate of ``kvgate serve --workers N``, CPU-bound on kvgate (docs/operations.md).

Starts simulated workers (``kvgate sim``, KV events on, timing sped up so they answer at once), then for
each N a ``kvgate serve --workers N`` on Redis in front of them, and drives it closed-loop: C connections
kept alive, each an agent sending its conversation's next short turn as soon as the last one is answered.
Reports requests/s over the measuring window and the CPU seconds each part spent per request (from
/proc), so a run on a shared machine can be read for what kvgate itself costs.

    PYTHONPATH=. python scripts/bench_serve_workers.py --workers 1 2 --seconds 15
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import aiohttp

from kvgate.serving import free_port

MODEL = "kvgate-tiny"
TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and its reaped children."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(f) for f in fields[11:15]) / TICK


def tree(pid: int) -> list[int]:
    kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [pid, *(p for k in kids for p in tree(int(k)))]


def tree_cpu(pid: int) -> float:
    total = 0.0
    for p in tree(pid):
        try:
            total += cpu_s(p)
        except FileNotFoundError:
            pass
    return total


def start(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "kvgate.cli", *args], stdout=log.open("wb"),
                            stderr=subprocess.STDOUT, start_new_session=True)


async def wait_ready(url: str, timeout_s: float = 120.0, path: str = "/ready") -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            try:
                async with s.get(url + path) as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
    raise TimeoutError(url)


async def agent(s: aiohttp.ClientSession, url: str, stop: asyncio.Event, counts: list[int]) -> None:
    conv = uuid.uuid4().hex
    messages = [{"role": "system", "content": "You are a coding agent. " * 20}]
    turn = 0
    while not stop.is_set():
        turn += 1
        if len(messages) > 12:  # a bounded history: the cost measured is a turn's, not a growing prompt's
            messages = messages[:1]
        messages.append({"role": "user", "content": f"step {turn}: run the tests"})
        body = {"model": MODEL, "messages": messages, "max_tokens": 8,
                "sim": {"reasoning_tokens": 0, "answer_tokens": 4}}
        async with s.post(url + "/v1/chat/completions", json=body, headers={"x-conversation-id": conv}) as r:
            out = await r.json()
            if r.status != 200:
                raise RuntimeError(f"{r.status}: {out}")
        messages.append({"role": "assistant", "content": out["choices"][0]["message"]["content"]})
        counts[0] += 1


async def drive(url: str, conns: int, warm_s: float, seconds: float, gw_pid: int, sim_pids: list[int]
                ) -> dict[str, float]:
    stop = asyncio.Event()
    counts = [0]
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=conns)) as s:
        tasks = [asyncio.create_task(agent(s, url, stop, counts)) for _ in range(conns)]
        await asyncio.sleep(warm_s)
        n0, t0 = counts[0], time.monotonic()
        g0, s0, c0 = tree_cpu(gw_pid), sum(tree_cpu(p) for p in sim_pids), cpu_s(os.getpid())
        await asyncio.sleep(seconds)
        n1, t1 = counts[0], time.monotonic()
        g1, s1, c1 = tree_cpu(gw_pid), sum(tree_cpu(p) for p in sim_pids), cpu_s(os.getpid())
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
    n = n1 - n0
    return {"rps": n / (t1 - t0), "requests": n, "gateway_cpu_ms_per_req": 1000 * (g1 - g0) / n,
            "gateway_cores": (g1 - g0) / (t1 - t0), "sim_cpu_ms_per_req": 1000 * (s1 - s0) / n,
            "client_cpu_ms_per_req": 1000 * (c1 - c0) / n, "load1": os.getloadavg()[0]}


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--sims", type=int, default=2)
    ap.add_argument("--connections", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--warm", type=float, default=4.0)
    ap.add_argument("--out", default="bench-out/serve-workers")
    a = ap.parse_args()
    out = Path(a.out)
    await asyncio.to_thread(out.mkdir, parents=True, exist_ok=True)
    from kvgate.tokens.tinymodel import ensure_tiny_model

    model_dir = ensure_tiny_model()
    sims: list[subprocess.Popen[bytes]] = []
    gw: subprocess.Popen[bytes] | None = None
    try:
        ports = []
        for i in range(a.sims):
            port = free_port()
            ports.append(port)
            sims.append(start(["sim", "--port", str(port), "--speed", "1000", "--model-dir", str(model_dir),
                               "--kv-events", f"tcp://127.0.0.1:{free_port()}",
                               "--kv-replay", f"tcp://127.0.0.1:{free_port()}"], out / f"sim{i}.log"))
        for port in ports:
            await wait_ready(f"http://127.0.0.1:{port}", 60, "/health")
        for n in a.workers:
            port = free_port()
            args = ["serve", "--workers", str(n), "--port", str(port), "--session-store", "redis",
                    "--redis-prefix", f"kvgate-bench:{uuid.uuid4().hex[:8]}:", "--hash-seed", "0",
                    "--tokenizers", json.dumps({MODEL: str(model_dir)})]
            for p in ports:
                args += ["--worker", f"http://127.0.0.1:{p}={MODEL}@sim,kv_events=auto,block_size=128"]
            gw = start(args, out / f"serve-{n}.log")
            url = f"http://127.0.0.1:{port}"
            await wait_ready(url)
            r = await drive(url, a.connections, a.warm, a.seconds, gw.pid, [s.pid for s in sims])
            print(json.dumps({"workers": n, **{k: round(v, 3) for k, v in r.items()}}), flush=True)
            gw.terminate()
            gw.wait(60)
            gw = None
    finally:
        for proc in [*sims, *([gw] if gw else [])]:
            proc.terminate()
            proc.wait(30)


if __name__ == "__main__":
    asyncio.run(main())
