"""``python -m kvgate.bench.storemem``: the resident memory of a ``kvgate serve`` process whose memory
store is bounded (``KVGATE_MAX_STORE_BYTES``, 8 MiB here) as distinct conversations pass through it.

One simulated worker runs as a process, the gateway as another (memory store, as deployed with one
replica); this process is the clients: ``N`` conversations of one turn each, every prompt ~2,500 tokens
of its own (so no two records share their text, tokens or block hashes), 16 at a time, on a worker with
vLLM's default 16-token blocks (a record keeps a block hash per block). Reported: the
gateway's RSS after a warm-up turn and after the ``N`` conversations. What the bound is for: the RSS
must stop growing with ``N`` once the records fill it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

import httpx

from kvgate.bench.hostile import rss_mb
from kvgate.dev.engines import EngineSet, free_ports, spawn, wait_http
from kvgate.tokens.tinymodel import ensure_tiny_model

MODEL = "kvgate-tiny"
WORDS = ("agent tool result file test error fix patch diff line module import class function value "
         "request cache worker block token prefix").split()
BOUND = 8 << 20


def prompt(rng: random.Random, words: int) -> list[dict[str, str]]:
    text = " ".join(f"{rng.choice(WORDS)}{rng.randrange(1000)}" for _ in range(words))
    return [{"role": "system", "content": "You are a coding agent."}, {"role": "user", "content": text}]


async def clients(url: str, n: int, words: int, concurrency: int = 16) -> tuple[int, int]:
    """(turns answered 200, prompt tokens of the last one)."""
    sem = asyncio.Semaphore(concurrency)
    ok = last = 0
    async with httpx.AsyncClient(base_url=url, timeout=120) as h:
        async def one(i: int) -> None:
            nonlocal ok, last
            rng = random.Random(i)
            async with sem:
                r = await h.post("/v1/chat/completions", headers={"x-conversation-id": f"mem-{i}"}, json={
                    "model": MODEL, "max_tokens": 16, "messages": prompt(rng, words)})
            if r.status_code == 200:
                ok += 1
                last = r.json()["usage"]["prompt_tokens"]
            elif i == 0:
                print(f"conversation 0: {r.status_code} {r.text[:300]}", file=sys.stderr)

        await asyncio.gather(*(one(i) for i in range(n)))
    return ok, last


def run(counts: tuple[int, ...], words: int, run_dir: Path, block_size: int = 16) -> str:
    model_dir = ensure_tiny_model()
    lines = [f"`kvgate serve`, memory store bounded to {BOUND >> 20} MiB (KVGATE_MAX_STORE_BYTES), one turn per "
             f"conversation, {block_size}-token KV blocks", "",
             "| conversations | prompt tokens | answered | RSS after warm-up (MB) | RSS after (MB) | seconds |",
             "|---|---|---|---|---|---|"]
    for n in counts:
        engines = EngineSet(run_dir=run_dir)
        sim_port, gw_port = free_ports(2)
        try:
            sim = spawn("sim", [sys.executable, "-m", "kvgate.cli", "--log-level", "WARNING", "sim", "--port",
                                str(sim_port), "--speed", "1000", "--block-size", str(block_size)],
                        {"KVGATE_SIM_MODEL_DIR": str(model_dir)}, engines.run_dir)
            sim.url = f"http://127.0.0.1:{sim_port}"
            engines.procs.append(sim)
            wait_http(sim, sim.url + "/health", 60)
            env = {"KVGATE_WORKERS": json.dumps([{"url": sim.url, "model": MODEL, "engine": "sim",
                                                  "block_size": block_size}]),
                   "KVGATE_TOKENIZERS": json.dumps({MODEL: str(model_dir)}), "KVGATE_MAX_STORE_BYTES": str(BOUND)}
            gw = spawn("kvgate", [sys.executable, "-m", "kvgate.cli", "--log-level", "WARNING", "serve", "--port",
                                  str(gw_port)], env, engines.run_dir)
            gw.url = f"http://127.0.0.1:{gw_port}"
            engines.procs.append(gw)
            wait_http(gw, gw.url + "/ready", 60)
            asyncio.run(clients(gw.url, 1, words, 1))
            rss0 = rss_mb(gw.pid)
            t0 = time.perf_counter()
            ok, tokens = asyncio.run(clients(gw.url, n, words))
            took = time.perf_counter() - t0
            lines.append(f"| {n:,} | {tokens:,} | {ok:,} | {rss0:.0f} | {rss_mb(gw.pid):.0f} | {took:.0f} |")
        finally:
            engines.stop()
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conversations", type=int, nargs="+", default=[2_000, 20_000])
    ap.add_argument("--words", type=int, default=610, help="words of each prompt (~2,500 tokens by default)")
    ap.add_argument("--block-size", type=int, default=16, help="the worker's KV block size (vLLM's default: 16)")
    ap.add_argument("--out", type=Path, default=Path("bench-out/storemem"))
    a = ap.parse_args()
    print(run(tuple(a.conversations), a.words, a.out, a.block_size))


if __name__ == "__main__":
    main()
