"""Every model protocol on its own chat template, on real vLLM workers, through kvgate.

One vLLM worker per template model (the tiny random model carrying Qwen3's, DeepSeek-V3.2's and R1's
(as vLLM ships them) and Kimi-K2-Thinking's template), started as a production deployment is: auto tool
choice with the family's tool and reasoning parsers. The random model still makes valid tool calls:
``tool_choice: "required"`` with a strict tool makes vLLM constrain the output to the family's
tool-call format and the tool's JSON schema (structured outputs, xgrammar on CPU), and
``thinking_token_budget`` ends its reasoning first. Then an agent runs a tool chain and a next user turn
as six clients: the exact one and five that re-serialise what they echo back. kvgate restores the exact
replies, so every client gets the exact client's cached tokens.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvgate.assembly import create_app
from kvgate.config import GatewaySettings, WorkerConfig
from kvgate.dev.engines import (
    EngineSet,
    Proc,
    VllmWorker,
    ensure_template_model,
    ensure_vllm,
    free_port,
    tail,
    wait_http,
)
from kvgate.dev.template_models import TEMPLATE_MODELS, TemplateModel
from kvgate.serving import start_server
from kvgate.tokens.tokenizer import ChatTokenizer
from tests.engine.conftest import reset_cache

TOOLS = [{"type": "function", "function": {
    "name": "bash", "description": "Run a command in the repository", "strict": True,
    "parameters": {"type": "object", "additionalProperties": False, "required": ["command", "timeout"],
                   "properties": {"command": {"type": "string", "enum": ["ls -la", "cat setup.py", "pytest -q"]},
                                  "timeout": {"type": "integer", "enum": [5, 30, 120]}}}}}]
SYSTEM = "You are a careful coding agent. Read the repository before you change anything. " * 8
CLIENTS = ("exact", "arguments re-dumped", "keys reordered", "reasoning omitted", "reasoning_content field",
           "content parts", "ids renumbered", "null content")


@dataclass
class Served:
    spec: TemplateModel
    proc: Proc
    model: Path


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Served]]:
    venv = ensure_vllm().venv
    models = {p: ensure_template_model(venv, p) for p in TEMPLATE_MODELS}
    s = EngineSet(run_dir=tmp_path_factory.mktemp("profiles"))
    try:
        procs = {p: s.spawn_vllm(VllmWorker(port=free_port(), core=i % (os.cpu_count() or 1),
                                            served_model=m.served, extra_args=m.vllm_args()), models[p])
                 for i, (p, m) in enumerate(TEMPLATE_MODELS.items())}
        for p in procs.values():  # four start-ups overlap: ~90 s on two cores
            wait_http(p, p.url + "/health", s.timeout)
        yield {p: Served(TEMPLATE_MODELS[p], procs[p], models[p]) for p in procs}
    finally:
        s.stop()


def echo(client: str, reply: dict[str, Any]) -> dict[str, Any]:
    """What ``client`` sends back of an assistant reply it received."""
    m: dict[str, Any] = {"role": "assistant", "content": reply.get("content") or ""}
    if reply.get("reasoning"):
        m["reasoning"] = reply["reasoning"]
    if reply.get("tool_calls"):
        m["tool_calls"] = [{"id": c["id"], "type": "function", "function": dict(c["function"])}
                           for c in reply["tool_calls"]]
    if client == "reasoning omitted":
        m.pop("reasoning", None)
    elif client == "reasoning_content field" and "reasoning" in m:
        m["reasoning_content"] = m.pop("reasoning")
    elif client == "content parts":
        m["content"] = [{"type": "text", "text": m["content"]}]
    elif client == "null content" and not m["content"].strip():
        m["content"] = None  # and no reasoning: what an SDK's message object dumps for a tool call
        m.pop("reasoning", None)
    for n, c in enumerate(m.get("tool_calls") or []):
        args = json.loads(c["function"]["arguments"])
        if client == "arguments re-dumped":
            c["function"]["arguments"] = json.dumps(args, separators=(",", ":"))
        elif client in ("keys reordered", "ids renumbered"):
            c["function"]["arguments"] = json.dumps(dict(reversed(list(args.items()))))
        if client == "ids renumbered":  # the client's own ids (its tool results name them)
            c["id"] = f"call_{n}_" + hashlib.blake2b(c["id"].encode(), digest_size=4).hexdigest()
    return m


def no_blank_tokens(tok: ChatTokenizer) -> dict[str, int]:
    """A logit bias against whitespace-only tokens: the tool-call grammar lets JSON have any whitespace
    between its tokens, and a random model fills it for ever; without it the call ends in a few tokens."""
    return {str(i): -100 for i in range(tok.vocab_size) if not tok.decode([i]).strip()
            and tok.decode([i]) not in tok.special_tokens}


async def agent(h: httpx.AsyncClient, gw: str, sv: Served, client: str) -> dict[str, Any]:
    """Two tool calls, an answer, a next user turn; what each step cached and what kvgate reported."""
    bias = no_blank_tokens(ChatTokenizer(sv.model))
    conv = f"{sv.spec.profile}-{client}".replace(" ", "-")
    msgs: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM},
                                  {"role": "user", "content": "Find out why the tests fail."}]
    out: dict[str, Any] = {"cached": [], "prompt": [], "expected": [], "restored": 0, "calls": 0, "steps": []}
    for step, choice in enumerate(("required", "required", "none", "none")):
        body = {"model": sv.spec.served, "messages": msgs, "tools": TOOLS, "tool_choice": choice, "max_tokens": 160,
                "temperature": 1.0, "seed": step, "parallel_tool_calls": False, "thinking_token_budget": 8,
                "chat_template_kwargs": sv.spec.template_kwargs, "logit_bias": bias}
        r = await h.post(gw + "/v1/chat/completions", json=body, headers={"x-conversation-id": conv})
        assert r.status_code == 200, (r.text, tail(Path(sv.proc.log), 15))
        j = r.json()
        assert "prompt_token_ids" not in j and "token_ids" not in j["choices"][0]  # kvgate's, not the client's
        reply = j["choices"][0]["message"]
        out["cached"].append(j["usage"]["prompt_tokens_details"]["cached_tokens"])
        out["prompt"].append(j["usage"]["prompt_tokens"])
        out["expected"].append(int(r.headers["x-kvgate-prefix-reuse"].split("cached=")[1].split(";")[0])
                               if "x-kvgate-prefix-reuse" in r.headers else None)
        out["restored"] += int(r.headers["x-kvgate-history"].split("restored=")[1].split(";")[0])
        out["steps"].append(j["usage"])
        if choice == "required":
            calls = reply.get("tool_calls") or []
            assert calls, (sv.spec.profile, step, reply)
            args = json.loads(calls[0]["function"]["arguments"])  # a valid call of a declared tool
            assert calls[0]["function"]["name"] == "bash" and isinstance(args, dict), calls
            out["calls"] += 1
            sent = echo(client, reply)
            msgs += [sent, {"role": "tool", "tool_call_id": sent["tool_calls"][0]["id"],
                            "content": f"output of {args.get('command')}"}]
        elif step == 2:
            msgs += [echo(client, reply), {"role": "user", "content": "Now fix it."}]
        else:
            out["last_reply"] = echo(client, reply)
    out["next_prefix"] = (await h.get(f"{gw}/admin/conversations/{conv}/next-prefix")).json()["token_ids"]
    out["turns"] = (await h.get(f"{gw}/admin/conversations/{conv}")).json()["turns"]
    out["last_messages"] = msgs
    return out


KNOWN = {
    # Found by this suite, not yet solved (issue 13's report): strict, so a fix shows up as a failure.
    "deepseek-v3": "after a tool result the V3.2 template writes no generation prompt; the random model then "
                   "makes no call through the deepseek_v3_1 structural tag",
    "kimi-k2": "vLLM 0.32 answers 500 (internal error during generation) to a kimi_k2 tool-call request "
               "of the agent",
}


@pytest.mark.parametrize("profile", [pytest.param(p, marks=pytest.mark.xfail(strict=True, reason=KNOWN[p]))
                                     if p in KNOWN else p for p in TEMPLATE_MODELS])
async def test_agent_on_the_profiles_own_template(served: dict[str, Served], profile: str) -> None:
    sv = served[profile]
    settings = GatewaySettings(
        workers=[WorkerConfig(url=sv.proc.url, model=sv.spec.served, engine="vllm", block_size=128)],
        tokenizers={sv.spec.served: str(sv.model)}, protocols={sv.spec.served: profile}, hash_seed="0")
    gw = await start_server(create_app(settings))
    results: dict[str, dict[str, Any]] = {}
    try:
        async with httpx.AsyncClient(timeout=300) as h:
            # kvgate renders this template exactly as the engine does (its parity probe passed).
            tok = ChatTokenizer(sv.model)
            for client in CLIENTS:
                await reset_cache(sv.proc.url)  # each client starts cold: no client inherits another's cache
                results[client] = await agent(h, gw.url, sv, client)
            exact = results["exact"]
            # The next turn's canonical prefix is a prefix of what the engine renders for the next request.
            nxt = [*exact["last_messages"], exact["last_reply"], {"role": "user", "content": "And then?"}]
            r = await h.post(sv.proc.url + "/tokenize", json={
                "model": sv.spec.served, "messages": nxt, "tools": TOOLS, "add_generation_prompt": True,
                "chat_template_kwargs": sv.spec.template_kwargs})
            engine_tokens = r.json()["tokens"]
            assert tok.encode_chat(nxt, TOOLS, template_kwargs=sv.spec.template_kwargs) == engine_tokens
            assert engine_tokens[: len(exact["next_prefix"])] == exact["next_prefix"]
    finally:
        await gw.stop()
    table = " | ".join(f"{c}: {results[c]['cached']}" for c in CLIENTS)
    print(f"\n{profile}: cached per step {table}")
    assert exact["calls"] == 2
    for client in CLIENTS[1:]:
        # Every re-serialising client gets what the exact client got: kvgate restored the exact replies.
        assert results[client]["cached"] == exact["cached"], (client, results[client]["cached"], exact["cached"])
        # Cached tokens can agree by luck (the exact client loses at every engine-generated call too: vLLM
        # re-dumps the arguments the model wrote compactly); the prompts agree only if the replies were restored.
        assert results[client]["prompt"] == exact["prompt"], (client, results[client]["prompt"], exact["prompt"])
    assert results["arguments re-dumped"]["restored"] >= 2 and results["reasoning omitted"]["restored"] >= 1
    assert results["ids renumbered"]["restored"] >= 2  # found by what the calls mean (issue 24)
    # kvgate's router expected what the engine reported cached.
    assert exact["expected"][1:] == exact["cached"][1:], (exact["expected"], exact["cached"])
    # Every lost token is explained: the causes add up to what the engine measured (reusable: the previous
    # prompt and all it generated but the last token, whose KV no engine computes).
    for client in CLIENTS:
        turns, steps = results[client]["turns"], results[client]["steps"]
        measured = sum(max(0, min(a["prompt_tokens"] + a["completion_tokens"] - 1, b["prompt_tokens"] - 1)
                           - b["prompt_tokens_details"]["cached_tokens"]) for a, b in pairwise(steps))
        explained = sum(t["lost_tokens"] + t["cache_lost_tokens"] for t in turns[1:])
        assert explained == measured, (client, explained, measured, [(t["loss_cause"], t["loss_detail"])
                                                                     for t in turns])
