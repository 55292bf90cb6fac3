"""Requests routed with a wrong expectation after a gateway restart, with and without warm start.

``python -m kvgate.bench.restart``: simulated workers publishing KV events, a gateway that serves agent
conversations until the workers' caches are warm, then a new gateway process-equivalent (a fresh app:
empty index, same shared session store, as a replica that restarts in front of a Redis store) in front
of the same workers. After the restart, the next turn of every conversation and new conversations
sharing the system prompts are sent one at a time (so nothing but the restart can make an expectation
wrong); a request is *wrong* when the cached tokens the gateway expected differ from those the worker
reported. Real HTTP, real ZMQ, real time (the simulators run fast).
"""

from __future__ import annotations

import argparse
import asyncio
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvgate.assembly import create_app
from kvgate.clock import MonotonicClock
from kvgate.config import GatewaySettings, WorkerConfig
from kvgate.kvstore.conversations import ConversationStore, MemoryConversationStore
from kvgate.kvstore.fleet import MemoryFleet
from kvgate.serving import ServerHandle, start_server
from kvgate.sim.server import SimWorker
from kvgate.sim.settings import SimSettings
from kvgate.tokens.tinymodel import ensure_tiny_model

MODEL = "kvgate-tiny"
TOOLS = [{"type": "function", "function": {"name": "search", "description": "search the code",
                                            "parameters": {"type": "object"}}}]


def _port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class Outcome:
    expected: list[int] = field(default_factory=list)
    cached: list[int] = field(default_factory=list)

    def add(self, expected: int, cached: int) -> None:
        self.expected.append(expected)
        self.cached.append(cached)

    @property
    def wrong(self) -> int:
        return sum(e != c for e, c in zip(self.expected, self.cached, strict=True))

    @property
    def first_wrong(self) -> int | None:
        return next((i for i, (e, c) in enumerate(zip(self.expected, self.cached, strict=True)) if e != c), None)

    @property
    def abs_error(self) -> int:
        return sum(abs(e - c) for e, c in zip(self.expected, self.cached, strict=True))


class Conversation:
    def __init__(self, name: str, system: str) -> None:
        self.name = name
        self.msgs: list[dict[str, Any]] = [{"role": "system", "content": system},
                                           {"role": "user", "content": f"task {name}: " + "find the bug " * 20}]

    async def step(self, http: httpx.AsyncClient, url: str) -> tuple[int, int]:
        """One agent step (a tool call and its result); returns (expected, cached) cached tokens."""
        r = await http.post(url + "/v1/chat/completions", headers={"x-conversation-id": self.name}, json={
            "model": MODEL, "messages": self.msgs, "tools": TOOLS, "sim": {"tool_calls": 1, "reasoning_tokens": 40}})
        r.raise_for_status()
        body = r.json()
        msg = body["choices"][0]["message"]
        self.msgs.append({k: v for k, v in msg.items() if v is not None})
        self.msgs.append({"role": "tool", "tool_call_id": msg["tool_calls"][0]["id"],
                          "content": f"result {len(self.msgs)} " * 40})
        cached = (body["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        return int(r.headers["x-kvgate-expected-cached-tokens"]), int(cached)


async def _gateway(settings: GatewaySettings, store: ConversationStore) -> ServerHandle:
    # The conversations outlive the gateway (as they would in Redis): only the gateway restarts.
    return await start_server(create_app(settings, stores=(store, MemoryFleet())))


async def run(warm_start: bool, workers: int = 3, conversations: int = 12, new: int = 12, warm_turns: int = 3
              ) -> Outcome:
    model_dir = ensure_tiny_model()
    sims: list[ServerHandle] = []
    for _ in range(workers):
        w = SimWorker(SimSettings(model_dir=str(model_dir), hash_seed="0", speed=50.0,
                                  kv_events_endpoint=f"tcp://127.0.0.1:{_port()}",
                                  kv_replay_endpoint=f"tcp://127.0.0.1:{_port()}"))
        sims.append(await start_server(w.build_app()))
    cfgs = [WorkerConfig(url=h.url, model=MODEL, engine="sim", block_size=128, kv_events="auto") for h in sims]
    settings = GatewaySettings(workers=cfgs, hash_seed="0", tokenizers={MODEL: str(model_dir)},
                               health_interval_s=0.5, kv_events_warm_start=warm_start)
    sessions = MemoryConversationStore(MonotonicClock(), 3600.0, 10_000)
    systems = [f"You are agent {k} of the team. Read the code before changing it. " * 12 for k in range(3)]
    convs = [Conversation(f"c{i}", systems[i % 3]) for i in range(conversations)]
    out = Outcome()
    try:
        async with httpx.AsyncClient(timeout=60) as http:
            gw = await _gateway(settings, sessions)
            for _ in range(warm_turns):
                await asyncio.gather(*(c.step(http, gw.url) for c in convs))
            await gw.stop()  # the replica restarts: its index is gone, the workers' caches are not
            gw = await _gateway(settings, sessions)
            after = [*convs, *(Conversation(f"n{i}", systems[i % 3]) for i in range(new))]
            for c in after:
                out.add(*await c.step(http, gw.url))
            await gw.stop()
    finally:
        for h in sims:
            await h.stop()
    return out


def table(rows: list[tuple[str, Outcome]]) -> str:
    lines = ["| gateway start | requests after restart | wrong expectation | first wrong (request #) "
             "| sum abs(expected - cached) tokens | cached tokens |", "|---|---|---|---|---|---|"]
    for name, o in rows:
        first = "–" if o.first_wrong is None else str(o.first_wrong + 1)
        lines.append(f"| {name} | {len(o.expected)} | {o.wrong} | {first} | {o.abs_error} | {sum(o.cached)} |")
    return "\n".join(lines)


async def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--conversations", type=int, default=12)
    ap.add_argument("--new", type=int, default=12)
    args = ap.parse_args(argv)
    rows = []
    for name, warm in (("before: index from each worker's next event", False),
                       ("after: warm start (replay at subscribe)", True)):
        rows.append((name, await run(warm, args.workers, args.conversations, args.new)))
    print(table(rows))


if __name__ == "__main__":
    asyncio.run(main())
