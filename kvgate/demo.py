"""``kvgate demo``: simulated workers plus the gateway in one process, driving one agent session.

Each turn prints the worker that served it, its prompt and cached tokens and the TTFT the client saw:
on a sticky worker the cached tokens grow turn over turn, because the history is byte-stable.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx

from kvgate.assembly import create_app, make_client
from kvgate.config import GatewaySettings, WorkerConfig
from kvgate.serving import ServerHandle, free_port, start_server
from kvgate.sim.server import SimWorker
from kvgate.sim.settings import SimSettings
from kvgate.tokens.tinymodel import ensure_tiny_model

T = TypeVar("T")

SYSTEM = ("You are a coding agent. Think step by step, call tools to inspect the repository, and answer "
          "briefly. " * 8).strip()
TOOLS = [
    {"type": "function", "function": {"name": "read_file", "description": "Read a file of the repository",
                                      "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                                                     "required": ["path"]}}},
    {"type": "function", "function": {"name": "run_tests", "description": "Run the test suite",
                                      "parameters": {"type": "object", "properties": {}}}},
]
USER_TURNS = [
    "The session cache misses after every tool call. Find out why.",
    "Now fix it and tell me which test covers the fix.",
    "Summarise the change in one paragraph for the pull request.",
]


@dataclass
class TurnResult:
    n: int
    conversation: str
    kind: str
    worker: str
    reason: str
    prompt_tokens: int
    cached_tokens: int
    ttft_ms: float
    finish: str
    expected_cached: int = 0


async def chat_turn(client: httpx.AsyncClient, url: str, conv: str, messages: list[dict[str, Any]]
                    ) -> tuple[dict[str, Any], dict[str, Any], str, float, httpx.Headers]:
    """One streaming request; returns the assembled message, usage, finish reason, TTFT and headers."""
    body = {"model": "kvgate-tiny", "messages": messages, "tools": TOOLS, "stream": True,
            "stream_options": {"include_usage": True}, "max_tokens": 256,
            "sim": {"reasoning_tokens": 48, "answer_tokens": 24}}
    t0 = time.perf_counter()
    ttft = 0.0
    msg: dict[str, Any] = {"role": "assistant", "content": "", "reasoning": "", "tool_calls": []}
    usage: dict[str, Any] = {}
    finish = ""
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body,
                             headers={"x-conversation-id": conv}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"gateway answered {r.status_code}: {(await r.aread()).decode()}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if obj.get("usage"):
                usage = obj["usage"]
            for ch in obj.get("choices", []):
                d = ch.get("delta", {})
                if not ttft and (d.get("content") or d.get("reasoning") or d.get("tool_calls")):
                    ttft = time.perf_counter() - t0
                msg["content"] += d.get("content") or ""
                msg["reasoning"] += d.get("reasoning") or ""
                for tc in d.get("tool_calls") or []:
                    msg["tool_calls"].append({"id": tc["id"], "type": "function", "function": tc["function"]})
                finish = ch.get("finish_reason") or finish
        headers = r.headers
    if not msg["tool_calls"]:
        del msg["tool_calls"]
    return msg, usage, finish, ttft, headers


async def run_session(client: httpx.AsyncClient, url: str, conv: str, start: int = 1, tool_s: float = 0.0
                      ) -> list[TurnResult]:
    """One agent: three user turns, each up to four steps; ``tool_s``: how long its tools run (a step's
    wait is drawn up to twice that, from the conversation's name, so a run is repeatable)."""
    rng = random.Random(conv)
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    out: list[TurnResult] = []
    n = start
    for user in USER_TURNS:
        messages.append({"role": "user", "content": f"[{conv}] {user}"})
        kind = "user"
        for _ in range(4):  # an agent step: reason, maybe call a tool, read its result, go on
            msg, usage, finish, ttft, headers = await chat_turn(client, url, conv, messages)
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            out.append(TurnResult(n, conv, kind, headers.get("x-kvgate-worker", "?"),
                                  headers.get("x-kvgate-route-reason", "?"), usage.get("prompt_tokens", 0),
                                  cached, ttft * 1000, finish,
                                  int(headers.get("x-kvgate-expected-cached-tokens", "0"))))
            n += 1
            messages.append(msg)
            if finish != "tool_calls":
                break
            for tc in msg["tool_calls"]:
                messages.append({"role": "tool", "tool_call_id": tc["id"],
                                 "content": f"output of {tc['function']['name']}: " + "line of output " * 40})
            if tool_s > 0:
                await asyncio.sleep(rng.uniform(0.0, 2 * tool_s))
            kind = "tool result"
    return out


async def _later(delay_s: float, aw: Awaitable[T]) -> T:
    if delay_s > 0:
        await asyncio.sleep(delay_s)
    return await aw


def print_table(rows: list[TurnResult]) -> None:
    head = f"{'turn':>4}  {'conversation':<12} {'after':<12} {'worker':<16} {'route':<28} {'prompt':>7} " \
           f"{'expected':>8} {'cached':>7} {'ttft ms':>8}  finish"
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r.n:>4}  {r.conversation:<12} {r.kind:<12} {r.worker:<16} {r.reason:<28} {r.prompt_tokens:>7} "
              f"{r.expected_cached:>8} {r.cached_tokens:>7} {r.ttft_ms:>8.1f}  {r.finish}")


async def run_demo(n_workers: int = 3, profile: str = "h100-llama3-8b", speed: float = 1.0, *,
                   agents: int = 3, request_log: str | None = None, tool_s: float = 0.0,
                   stagger_s: float = 0.0, quiet: bool = False) -> list[TurnResult]:
    """``request_log``: the gateway writes its request log there (``kvgate tune`` replays it);
    ``stagger_s``: the agents start that far apart (at 0, all at once)."""
    model_dir = ensure_tiny_model()
    sims: list[tuple[SimWorker, ServerHandle]] = []
    gw: ServerHandle | None = None
    try:
        for _ in range(n_workers):
            # Each simulated worker publishes vLLM-format KV events; the gateway finds them through
            # /kv_event_sources and routes on exactly what every worker holds.
            w = SimWorker(SimSettings(model_dir=str(model_dir), profile=profile, hash_seed="0", speed=speed,
                                      kv_events_endpoint=f"tcp://127.0.0.1:{free_port()}",
                                      kv_replay_endpoint=f"tcp://127.0.0.1:{free_port()}"))
            sims.append((w, await start_server(w.build_app())))
        settings = GatewaySettings(
            workers=[WorkerConfig(url=h.url, model="kvgate-tiny", engine="sim", block_size=w.profile.block_size,
                                  kv_events="auto") for w, h in sims],
            policy="cost_model", tokenizers={"kvgate-tiny": str(model_dir)}, hash_seed="0", health_interval_s=1.0,
            request_log=request_log)
        gw = await start_server(create_app(settings))
        if not quiet:
            print(f"kvgate demo: gateway {gw.url}, {n_workers} simulated vLLM workers ({profile} timing, KV events), "
                  f"policy cost_model\n")
        names = [f"agent-{chr(65 + i)}" if agents <= 26 else f"agent-{i + 1}" for i in range(agents)]
        async with make_client(60.0) as client:
            # The agents at once: the cost model weighs each one's cached prefix against the queue
            # the others are building on the same worker.
            per = await asyncio.gather(*(_later(i * stagger_s, run_session(client, gw.url, conv, tool_s=tool_s))
                                         for i, conv in enumerate(names)))
            rows = [r for session in per for r in session]
        if not quiet:
            print_table(rows)
        if request_log and not quiet:
            print(f"\nrequest log: {request_log} (replay it with: kvgate tune {request_log})")
        return rows
    finally:
        if gw is not None:
            await gw.stop()
        for _, h in sims:
            await h.stop()
