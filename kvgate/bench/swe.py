"""``kvgate bench swe``: the 22 SWE-agent trajectories replayed through the gateway under five clients.

Each trajectory becomes an OpenAI tool-calling conversation (the thought as reasoning, the action as a
tool call, the observation as the tool's result — or as a user message where the trajectory used one).
The simulated worker replays the recorded outputs exactly (``sim.reasoning_text`` and the recorded
call), so every client sees the same model; only what the client sends back differs:

- kvgate canonical (keep): the client echoes the history; kvgate keeps reasoning;
- kvgate canonical (drop at turn end): the same client, policy ``drop``;
- re-serialising client: tool-call arguments re-dumped compactly, reasoning under ``reasoning_content``
  (kvgate restores the exact form);
- stateless merge: the whole history merged into one user message every step;
- summarise early: every 4 steps the history is replaced by a short summary.

Per client: prompt tokens sent, tokens recomputed, hit rate, mean active context, the loss causes
kvgate reported, and whether they add up to the measured loss.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from kvgate.assembly import create_app, make_client
from kvgate.bench.data import read_text
from kvgate.config import GatewaySettings, WorkerConfig
from kvgate.serving import start_server
from kvgate.sim.server import SimWorker
from kvgate.sim.settings import SimSettings
from kvgate.tokens.tinymodel import ensure_tiny_model

MODEL = "kvgate-tiny"
TOOLS = [{"type": "function", "function": {"name": "bash", "description": "Run a command in the repository",
                                            "parameters": {"type": "object", "properties": {
                                                "command": {"type": "string"}}, "required": ["command"]}}}]
CLIENTS = ("kvgate canonical (keep)", "kvgate canonical (drop at turn end)", "re-serialising client",
           "stateless merge", "summarise early")


@dataclass
class Step:
    thought: str
    action: str
    observation: str
    observation_role: str


@dataclass
class Trajectory:
    name: str
    system: str
    task: str
    steps: list[Step]


def load_trajectories(folder: Path, max_chars: int = 6000) -> list[Trajectory]:
    out = []
    for f in sorted(folder.glob("*.traj*")):
        h = json.loads(read_text(f))["history"]
        system = next((m["content"] for m in h if m.get("role") == "system"), "")
        first_user = next((i for i, m in enumerate(h) if m.get("role") == "user"), 0)
        task = str(h[first_user]["content"])
        steps: list[Step] = []
        i = first_user + 1
        while i < len(h):
            m = h[i]
            if m.get("role") == "assistant":
                obs = h[i + 1] if i + 1 < len(h) and h[i + 1].get("role") in ("user", "tool") else None
                steps.append(Step(str(m.get("thought") or m.get("content") or ""), str(m.get("action") or "").strip(),
                                  str(obs["content"] if obs else "")[:max_chars],
                                  "tool" if (obs and obs.get("role") == "tool") else "user"))
                i += 2 if obs else 1
            else:
                i += 1
        if steps:
            out.append(Trajectory(f.name.split(".traj")[0], str(system)[:max_chars], task[:max_chars], steps))
    return out


def _call(step: Step, i: int) -> dict[str, Any]:
    return {"id": f"call_{i}", "type": "function",
            "function": {"name": "bash", "arguments": json.dumps({"command": step.action})}}


def client_messages(client: str, t: Trajectory, k: int, replies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What this client sends for step k (0-based), given the replies it received so far."""
    head = [{"role": "system", "content": t.system}, {"role": "user", "content": t.task}]
    if client == "stateless merge":
        lines = [f"TASK: {t.task}"]
        for i in range(k):
            lines.append(f"THOUGHT: {t.steps[i].thought}\nACTION: {t.steps[i].action}\nOBSERVATION: "
                         f"{t.steps[i].observation}")
        return [{"role": "system", "content": t.system}, {"role": "user", "content": "\n\n".join(lines)}]
    start = 0
    msgs = list(head)
    if client == "summarise early" and k >= 4:
        start = (k // 4) * 4
        summary = " ".join(s.action for s in t.steps[:start])
        msgs.append({"role": "user", "content": f"Summary of the work so far: ran {summary[:400]}"})
    for i in range(start, k):
        r = dict(replies[i])
        if client == "re-serialising client":
            r = {"role": "assistant", "content": r.get("content") or "", "reasoning_content": r.get("reasoning"),
                 "tool_calls": [{**c, "function": {**c["function"], "arguments": json.dumps(
                     json.loads(c["function"]["arguments"]), separators=(",", ":"))}} for c in r["tool_calls"]]}
        msgs.append(r)
        call_id = r["tool_calls"][0]["id"]
        s = t.steps[i]
        if s.observation_role == "tool":
            msgs.append({"role": "tool", "tool_call_id": call_id, "content": s.observation})
        else:
            msgs.append({"role": "user", "content": s.observation})
    return msgs


@dataclass
class ClientResult:
    client: str
    prompt_tokens: int = 0
    cached: int = 0
    requests: int = 0
    causes: Counter[str] | None = None
    explained: int = 0
    measured: int = 0


async def run_client(client: str, trajectories: list[Trajectory], gw_url: str | Sequence[str],
                     http: httpx.AsyncClient, rng: random.Random | None = None) -> ClientResult:
    """Replay ``trajectories`` as ``client``; with several gateway URLs (replicas sharing one store), each
    request goes to one picked at random."""
    urls = [gw_url] if isinstance(gw_url, str) else list(gw_url)
    rng = rng or random.Random(0)
    res = ClientResult(client, causes=Counter())
    policy = "drop" if "drop" in client else "keep"
    for n, t in enumerate(trajectories):
        conv = f"{CLIENTS.index(client)}-{n}"
        replies: list[dict[str, Any]] = []
        prev_total: int | None = None
        for k, step in enumerate(t.steps):
            body = {"model": MODEL, "messages": client_messages(client, t, k, replies), "tools": TOOLS,
                    "max_tokens": 4000, "reasoning_policy": policy,
                    "sim": {"reasoning_text": step.thought, "content_text": "",
                            "tool_calls": [{"name": "bash", "arguments": {"command": step.action}}]}}
            r = await http.post(rng.choice(urls) + "/v1/chat/completions", json=body,
                                headers={"x-conversation-id": conv})
            r.raise_for_status()
            j = r.json()
            msg = {k2: v for k2, v in j["choices"][0]["message"].items() if v is not None}
            if not msg.get("tool_calls"):
                raise RuntimeError(f"{t.name} step {k}: the replayed reply lost its tool call "
                                   f"(finish {j['choices'][0]['finish_reason']}): {str(msg)[:300]}")
            replies.append(msg)
            u = j["usage"]
            cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            res.prompt_tokens += u["prompt_tokens"]
            res.cached += cached
            res.requests += 1
            if prev_total is not None:
                # Measured from the client's side: the previous prompt and everything generated for it but
                # the last token (whose KV no engine computes) could have been reused, up to this prompt's
                # last token.
                res.measured += max(0, min(prev_total - 1, u["prompt_tokens"] - 1) - cached)
            prev_total = u["prompt_tokens"] + u["completion_tokens"]
        rec = (await http.get(f"{rng.choice(urls)}/admin/conversations/{conv}")).json()
        for turn in rec["turns"][1:]:
            if turn["loss_cause"]:
                res.causes[turn["loss_cause"]] += turn["lost_tokens"]  # type: ignore[index]
            if turn["cache_loss_cause"]:
                res.causes[turn["cache_loss_cause"]] += turn["cache_lost_tokens"]  # type: ignore[index]
            res.explained += turn["lost_tokens"] + turn["cache_lost_tokens"]
    return res


async def replay(folder: Path) -> list[ClientResult]:
    trajectories = load_trajectories(folder)
    model_dir = ensure_tiny_model()
    out = []
    for client in CLIENTS:
        # A fresh worker per client: no client inherits another's cache.
        w = SimWorker(SimSettings(model_dir=str(model_dir), profile="h100-llama3-8b", max_model_len=262144,
                                  num_blocks=400_000, hash_seed="0", speed=1000.0))
        sim = await start_server(w.build_app())
        gw = await start_server(create_app(GatewaySettings(
            workers=[WorkerConfig(url=sim.url, model=MODEL, engine="sim", block_size=16)],
            tokenizers={MODEL: str(model_dir)}, hash_seed="0", max_body_bytes=64 * 1024 * 1024)))
        try:
            async with make_client(120.0) as http:
                out.append(await run_client(client, trajectories, gw.url, http))
        finally:
            await gw.stop()
            await sim.stop()
    return out


def table(results: list[ClientResult]) -> str:
    lines = ["| client | requests | prompt tokens sent | tokens recomputed | hit rate | mean active context | "
             "loss causes reported (tokens) | explained / measured loss |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        causes = ", ".join(f"{c} {n:,}" for c, n in (r.causes or Counter()).most_common()) or "–"
        lines.append(f"| {r.client} | {r.requests} | {r.prompt_tokens:,} | {r.prompt_tokens - r.cached:,} | "
                     f"{r.cached / max(1, r.prompt_tokens):.3f} | {r.prompt_tokens / max(1, r.requests):,.0f} | "
                     f"{causes} | {r.explained:,} / {r.measured:,} |")
    return "\n".join(lines) + "\n"


def run(folder: Path, out_dir: Path = Path("bench-out")) -> str:
    results = asyncio.run(replay(folder))
    text = "# kvgate bench swe\n\n" + table(results)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "swe.md").write_text(text)
    print(text)
    return text

