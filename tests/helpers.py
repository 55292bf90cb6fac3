"""Helpers several test modules share: clients, metrics, polling and scripted agents against a cluster
(tests/conftest.py), simulated worker processes, stepping a simulated engine, API-key auth settings and a
model directory with its config.json. Kept out of the test modules so importing one does not import
another's tests."""

from __future__ import annotations

import asyncio
import itertools
import json
import shutil
import time
from pathlib import Path
from typing import Any

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from kvgate.gateway.auth import key_hash
from kvgate.sim.engine import EngineCore
from tests.conftest import MODEL, Cluster, free_port

TOOLS = [{"type": "function", "function": {"name": "search", "description": "search the code",
                                            "parameters": {"type": "object"}}}]


def client(c: Cluster, **kw: Any) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=c.url + "/v1", api_key="unused", max_retries=0, **kw)


async def metric(c: Cluster, name: str, **labels: str) -> float:
    async with httpx.AsyncClient() as h:
        text = (await h.get(c.url + "/metrics")).text
    total = 0.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


async def eventually(pred: Any, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await pred() if asyncio.iscoroutinefunction(pred) else pred():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("condition not met in time")


async def run_agent(oc: openai.AsyncOpenAI, conv: str | None, steps: int,
                    headers: dict[str, str] | None = None) -> list[tuple[str, int, int]]:
    """An agent loop: every step calls a tool and feeds its result back. Returns (worker, prompt, cached)."""
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "You are an agent. " * 40},
                                  {"role": "user", "content": f"task for {conv}"}]
    out = []
    for i in range(steps):
        raw = await oc.chat.completions.with_raw_response.create(
            model=MODEL, messages=msgs, tools=TOOLS,  # type: ignore[arg-type]
            extra_headers=headers or ({"x-conversation-id": conv} if conv else {}),
            extra_body={"sim": {"tool_calls": 1, "reasoning_tokens": 30}})
        r = raw.parse()
        m = r.choices[0].message
        assert m.tool_calls, "the scripted agent calls a tool every step"
        msgs.append(m.model_dump(exclude_none=True))
        msgs.append({"role": "tool", "tool_call_id": m.tool_calls[0].id, "content": f"result {i} " * 30})
        assert r.usage is not None
        cached = r.usage.prompt_tokens_details.cached_tokens if r.usage.prompt_tokens_details else 0
        out.append((raw.headers["x-kvgate-worker"], r.usage.prompt_tokens, cached or 0))
    return out


async def agent_turns(c: Cluster, conv: str, steps: int, system: str = "You are an agent. " * 60,
                      result_words: int = 80) -> list[tuple[str, str, int, int, int]]:
    """(worker, reason, prompt, cached, expected) per step of an agent loop."""
    oc = client(c)
    msgs: list[dict[str, Any]] = [{"role": "system", "content": system}, {"role": "user", "content": f"task {conv}"}]
    out = []
    for i in range(steps):
        raw = await oc.chat.completions.with_raw_response.create(
            model=MODEL, messages=msgs, tools=TOOLS,  # type: ignore[arg-type]
            extra_headers={"x-conversation-id": conv}, extra_body={"sim": {"tool_calls": 1, "reasoning_tokens": 40}})
        r = raw.parse()
        m = r.choices[0].message
        msgs.append(m.model_dump(exclude_none=True))
        msgs.append({"role": "tool", "tool_call_id": m.tool_calls[0].id, "content": f"result {i} " * result_words})  # type: ignore[index]
        assert r.usage is not None and r.usage.prompt_tokens_details is not None
        out.append((raw.headers["x-kvgate-worker"], raw.headers["x-kvgate-route-reason"], r.usage.prompt_tokens,
                    r.usage.prompt_tokens_details.cached_tokens or 0,
                    int(raw.headers["x-kvgate-expected-cached-tokens"])))
    return out


async def chat(c: Cluster, conv: str, messages: list[dict[str, Any]], headers: dict[str, str] | None = None,
               **extra: Any) -> httpx.Response:
    body = {"model": MODEL, "messages": messages, "tools": TOOLS, **extra}
    async with httpx.AsyncClient(timeout=30) as h:
        return await h.post(c.url + "/v1/chat/completions", json=body,
                            headers={"x-conversation-id": conv, **(headers or {})})


async def ready(c: Cluster) -> None:
    await eventually(lambda: len(c.gateway.prefix.events.workers()) == len(c.sims))


async def assert_losses_named(c: Cluster, conversation: str) -> None:
    """Inside a tool chain the record names every lost token, and only the last partial block is lost."""
    async with httpx.AsyncClient() as h:
        turns = (await h.get(f"{c.url}/admin/conversations/{conversation}")).json()["turns"]
    print("lost, cause, detail; cache-side lost, cause:",
          [(t["lost_tokens"], t["loss_cause"], t["loss_detail"], t["cache_lost_tokens"], t["cache_loss_cause"])
           for t in turns])
    assert len(turns) >= 2
    for prev, t in itertools.pairwise(turns):
        # A previous reply that ended exactly on a block boundary leaves that block incomplete (no engine
        # computes the KV of the last token it generates): partial-block loss, not a cache miss.
        assert t["lost_tokens"] < 128 and t["loss_cause"] == ("block_alignment" if t["lost_tokens"] else None), t
        assert t["cache_lost_tokens"] == 0 and t["cache_loss_cause"] is None, (prev, t)


async def start_sims(spawn: Any, model_dir: Path, n: int, *extra: str) -> list[tuple[Any, str]]:
    out = []
    for _ in range(n):
        port = free_port()
        p = spawn("sim", "--port", str(port), "--model-dir", str(model_dir), *extra, env={"PYTHONHASHSEED": "0"})
        out.append((p, f"http://127.0.0.1:{port}"))
    for p, url in out:
        await p.wait_http(url + "/health")
    return out


def run(c: EngineCore, now: float = 0.0) -> float:
    while c.has_work():
        plan = c.schedule()
        assert plan.scheduled, "engine stalled"
        now += plan.duration_ms
        c.finish_step(plan, now)
    return now


# API keys of tests/test_auth.py's gateways, also used by the endpoint picker's tenant tests.
SECRET = "s3cret-salt-key"
KEYS = {"key-a": ("A", "tenant"), "key-b": ("B", "tenant"), "key-ops": ("", "operator"), "key-none": ("A", "none")}


def api_keys() -> list[dict[str, str]]:
    return [{"sha256": key_hash(k), "tenant": t, "role": r, "name": k} for k, (t, r) in KEYS.items()]


def auth(**kw: Any) -> dict[str, Any]:
    return {"mode": "api_key", "api_keys": api_keys(), "cache_salt_secret": SECRET, **kw}


TINY_CONFIG = {"architectures": ["LlamaForCausalLM"], "hidden_size": 128, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "dtype": "bfloat16"}
"""The tiny model's geometry as ``tinymodel.build_weights`` writes it for the real engine."""
TINY_KV_BYTES = 2 * 2 * 2 * 32 * 2  # K and V x layers x KV heads x head dim x bfloat16


def model_dir_with_config(model_dir: Path, out: Path) -> Path:
    """The tokenizer plus the model's config.json, as a served model's directory has them."""
    shutil.copytree(model_dir, out)
    (out / "config.json").write_text(json.dumps(TINY_CONFIG))
    return out
