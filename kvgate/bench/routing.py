"""Routing cost on the gateway's real code path (no HTTP): prompt preparation, index match and policy,
for a cold and a known 32k-token conversation; KV event ingestion rate; index memory."""

from __future__ import annotations

import asyncio
import random
import time
import tracemalloc
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack

from kvgate.bench.report import cdf_plot, pct
from kvgate.gateway.prompts import PromptBuilder
from kvgate.router.cost import CostModel, CostParams
from kvgate.router.hashing import HashSpec
from kvgate.router.index import PrefixIndex
from kvgate.router.kvevents import KvEventState
from kvgate.router.types import ConversationId, FleetView, RouteRequest, WorkerId, WorkerView
from kvgate.session.conversation import Chain
from kvgate.tokens.tinymodel import WORDS, ensure_tiny_model
from kvgate.tokens.tokenizer import ChatTokenizer


@dataclass
class Timing:
    name: str
    p50_ms: float
    p99_ms: float
    target: str
    samples_ms: list[float] = field(default_factory=list)


def _timing(name: str, xs: list[float], target: str = "") -> Timing:
    return Timing(name, pct(xs, 0.5), pct(xs, 0.99), target, xs)


def _conversation(target_tokens: int, tok: ChatTokenizer, seed: int = 0) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "You are a coding agent. " * 40}]
    while len(tok.encode_chat(msgs)) < target_tokens:
        msgs.append({"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(400))})
        msgs.append({"role": "assistant", "content": " ".join(rng.choice(WORDS) for _ in range(400))})
    return msgs


async def routing_timings(n: int = 40) -> list[Timing]:
    tok = ChatTokenizer(ensure_tiny_model(), sandbox=False)  # the gateway's default (template_sandbox)

    async def no_worker(model: str, body: dict[str, Any]) -> list[int] | None:
        return None

    spec = HashSpec(16, seed="0")
    builder = PromptBuilder({"m": tok}, lambda m: [spec], no_worker)
    chains: dict[str, Chain | None] = {}
    index = PrefixIndex()
    workers = [WorkerId(f"w{i}") for i in range(8)]
    rng = random.Random(1)
    for w in workers:  # a realistic background: 8 workers x 100k cached blocks
        index.store(w, (rng.getrandbits(64) for _ in range(100_000)))
    policy = CostModel(CostParams())
    fleet = FleetView(tuple(WorkerView(w, "m", True, rng.randint(0, 4), pending_prefill_tokens=rng.randint(0, 9000),
                                       pending_requests=rng.randint(0, 3)) for w in workers))
    base = _conversation(32_000, tok)

    async def decide(conv: str, msgs: list[dict[str, Any]]) -> tuple[float, float]:
        t0 = time.perf_counter()
        chain = chains.get(conv)
        # As the gateway does: a conversation without a chain is tokenized only as far as a worker holds it.
        prompt = await builder.prepare("m", "chat", {"model": "m", "messages": msgs}, chain,
                                       held=None if chain else lambda sp, block: any(
                                           index.holds(w, block) for w in workers))
        t1 = time.perf_counter()
        matched = index.match(prompt.hashes[spec], workers=workers)
        d = policy.pick(RouteRequest("m", ConversationId(conv), workers[0], prompt_tokens=prompt.length,
                                     matched_blocks=matched), fleet)
        assert d is not None
        t2 = time.perf_counter()
        if conv.startswith("known"):
            index.store(d.worker, prompt.hashes[spec])  # what the worker's events would report
            # What the conversation's record holds for its next turn (built after the response, off the
            # request path): the whole prompt as a chain.
            chains[conv] = builder.chain_for("m", msgs, None, prompt.chain)
        return t1 - t0, t2 - t1

    cold_full, cold_decide, known_full, known_decide = [], [], [], []
    for i in range(n):
        a, b = await decide(f"cold-{i}", [*base[:-1], {"role": "assistant", "content": f"variant {i}"}])
        cold_full.append((a + b) * 1000)
        cold_decide.append(b * 1000)
    msgs = list(base)
    await decide("known", msgs)
    for i in range(n):
        msgs = [*msgs, {"role": "user", "content": f"and now step {i}: " + " ".join(WORDS[:30])}]
        a, b = await decide("known", msgs)
        known_full.append((a + b) * 1000)
        known_decide.append(b * 1000)
    cached_full = []
    for i in range(n):  # a conversation kvgate holds no record of, whose whole history a worker caches
        a, b = await decide(f"cached-{i}", [*base, {"role": "user", "content": f"another question {i}"}])
        cached_full.append((a + b) * 1000)
    return [
        _timing("cold 32k-token conversation (no worker holds it): render + tokenize as far as held + hash + "
                "match + pick", cold_full, "≤ 20 ms p99"),
        _timing("cold: match + pick only", cold_decide),
        _timing("no record, history cached on a worker (all of it must be tokenized)", cached_full, "≤ 20 ms p99"),
        _timing("known 32k-token conversation, new turn: incremental prompt + match + pick", known_full,
                "≤ 1 ms p99"),
        _timing("known: match + pick only (the routing decision)", known_decide),
    ]


def ingestion_rate(n_blocks: int = 400_000, per_batch: int = 16) -> tuple[float, float]:
    """Block events applied per second on one core (stores then removals), and index bytes per block."""
    rng = random.Random(2)
    hashes = [rng.getrandbits(64) for _ in range(n_blocks)]
    stored = [msgpack.packb([0.0, [{"type": "BlockStored", "block_hashes": hashes[i:i + per_batch],
                                    "parent_block_hash": None, "token_ids": [], "block_size": 16, "medium": "GPU"}], 0])
              for i in range(0, n_blocks, per_batch)]
    removed = [msgpack.packb([0.0, [{"type": "BlockRemoved", "block_hashes": hashes[i:i + per_batch], "medium": "GPU"}],
                              0]) for i in range(0, n_blocks, per_batch)]
    tracemalloc.start()
    state = KvEventState(PrefixIndex())
    w = WorkerId("w0")
    state.add_worker(w)
    t0 = time.perf_counter()
    for seq, payload in enumerate(stored):
        state.on_message(w, seq, payload)
    t_store = time.perf_counter() - t0
    mem = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    t0 = time.perf_counter()
    for seq, payload in enumerate(removed, start=len(stored)):
        state.on_message(w, seq, payload)
    t_remove = time.perf_counter() - t0
    return 2 * n_blocks / (t_store + t_remove), mem / n_blocks


def report(plot: Path | None = None) -> str:
    """The routing-cost table; with ``plot``, the CDF of every timed path drawn there."""
    timings = asyncio.run(routing_timings())
    rate, bytes_per_block = ingestion_rate()
    lines = ["### Routing cost (gateway code path, this machine, one core)", "",
             "| path | p50 (ms) | p99 (ms) | target |", "|---|---|---|---|"]
    lines += [f"| {t.name} | {t.p50_ms:.2f} | {t.p99_ms:.2f} | {t.target} |" for t in timings]
    lines += ["", f"KV event ingestion: {rate:,.0f} block events/s on one core (issue 25 target ≥ 500,000); "
              f"index memory {bytes_per_block:.0f} bytes per cached block.", ""]
    if plot is not None:
        cdf_plot(plot, [("routing cost per request", [(t.name, t.samples_ms) for t in timings])], "ms (log)")
        lines += [f"Plot: {plot}", ""]
    return "\n".join(lines)
