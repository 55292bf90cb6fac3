"""The Responses and Messages doors in front of two real vLLM workers, driven by the official SDKs.

The tiny model has random weights and never calls a tool on its own, so the test is the agent: after
each answer it appends a tool call of its own making (a ``function_call`` item, or a ``tool_use`` block
beside the engine's text) and the tool's result, and asks again — the requests a tool loop sends. On
every request kvgate's expected cached tokens must equal what vLLM reports; the agent stays on one
worker; the cache grows step after step; every history token not reused is named with a cause; and a
stored response is continued (``previous_response_id``) and retrieved."""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from kvgate.assembly import create_app
from kvgate.config import GatewaySettings, WorkerConfig
from kvgate.router.cost import CostParams
from kvgate.serving import ServerHandle, start_server
from kvgate.tokens.tokenizer import ChatTokenizer
from tests.engine.conftest import Pair

MODEL = "kvgate-tiny"
STEPS = 4
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
# The suite's workers run without a tool parser, and vLLM refuses tool_choice "auto" without one; with
# "none" the tools are still rendered into the prompt (so kvgate hashes what a tool loop sends) and the
# engine answers in text, which it would anyway: the random model calls no tool.
RESPONSES_TOOLS: list[Any] = [{"type": "function", "name": "search", "description": "search the code",
                               "parameters": {"type": "object", "properties": {"query": {"type": "string"}}}}]
MESSAGES_TOOLS: list[Any] = [{"name": "search", "description": "search the code",
                              "input_schema": {"type": "object", "properties": {"query": {"type": "string"}}}}]


def system() -> str:
    # Its own prefix per test: the session's workers keep what earlier tests cached.
    return f"[{uuid.uuid4().hex}] You are a careful coding agent. Read the code before you change it. " * 12


def tool_output(i: int) -> str:
    return f"step {i}: search found the cache in kvgate/store.py, line {40 + i}. " * 6


@pytest.fixture
async def gateway(pair: Pair) -> AsyncIterator[ServerHandle]:
    settings = GatewaySettings(
        workers=[WorkerConfig(url=w.url, model=MODEL, engine="vllm", block_size=128, hash_algo=w.spec.hash_algo,
                              kv_events=w.events, kv_replay=w.replay) for w in (pair.a, pair.b)],
        tokenizers={MODEL: str(pair.model)}, hash_seed="0", health_interval_s=1.0,
        cost=CostParams(p0_ms=5.0, p1_ms=0.17, p2_ms=0.0, decode_ms=4.0, token_budget=2048))
    gw = await start_server(create_app(settings))
    yield gw
    await gw.stop()


def generation_prompt_tokens(model: Path) -> int:
    """The tokens the template appends to a prompt for the answer (thinking off: ``<|im_start|>assistant``
    and an empty ``<think></think>``). The next request renders that answer without the empty think block,
    so its prompt may leave the previous one's a few tokens before that prompt's end."""
    tok = ChatTokenizer(model)
    msgs = [{"role": "user", "content": "u"}]
    return len(tok.encode_chat(msgs, template_kwargs=NO_THINKING["chat_template_kwargs"])) - \
        len(tok.encode_chat(msgs, add_generation_prompt=False))


async def check(gw: ServerHandle, steps: list[tuple[str, str, int, int]], messages_per_step: int,
                generation_prompt: int) -> None:
    """``steps``: (worker, conversation id, engine-reported cached, kvgate's expected) per request;
    ``messages_per_step``: the chat messages each step adds to the prompt (which starts with two);
    ``generation_prompt``: ``generation_prompt_tokens``."""
    async with httpx.AsyncClient() as h:
        conv = (await h.get(f"{gw.url}/admin/conversations/{steps[0][1]}")).json()
    turns = conv["turns"]
    print("worker / prompt / cached / expected / lost (cause, detail):",
          [(t["worker"][-5:], t["prompt_tokens"], t["cached_tokens"], t["expected_cached_tokens"], t["lost_tokens"],
            t["loss_cause"], t["loss_detail"]) for t in turns])
    assert len({c for _, c, _, _ in steps}) == 1 and len(turns) == len(steps)
    assert len({w for w, _, _, _ in steps}) == 1 and {t["worker"] for t in turns} == {steps[0][0]}
    cached = [c for _, _, c, _ in steps]
    assert cached == [e for _, _, _, e in steps] == [t["cached_tokens"] for t in turns]  # expected == reported
    assert cached[0] == 0 and all(b > a for a, b in itertools.pairwise(cached)), cached
    for i, (prev, t) in enumerate(itertools.pairwise(turns)):
        assert t["cache_lost_tokens"] == 0, t  # nothing rerouted or evicted
        # The agent's own call follows the engine's answer, so the prompt leaves the cached chain only
        # after the previous prompt (less the generation prompt's empty think block, which the answer's
        # rendering drops: a run failed on a divergence 6 tokens before a block boundary): all of its
        # whole blocks are reused ...
        assert t["cached_tokens"] >= (prev["prompt_tokens"] - generation_prompt) // 128 * 128, (prev, t)
        # ... and what is lost is named at the message where it diverged: the answer or after it.
        assert not t["lost_tokens"] or t["loss_cause"], t
        if t["loss_cause"] not in (None, "block_alignment"):
            at = re.match(r"message (\d+)", t["loss_detail"])
            assert at and int(at[1]) >= 2 + messages_per_step * i, t


async def settle() -> None:
    await asyncio.sleep(0.3)  # the worker's KV events reach kvgate before the next request (a tool's time)


@pytest.mark.parametrize("stream", [False, True], ids=["create", "stream"])
async def test_responses_tool_loop_on_real_vllm(gateway: ServerHandle, pair: Pair, stream: bool) -> None:
    oc = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0, timeout=120)
    instructions = system()
    prev: Any = None
    new_input: Any = "find the cache bug"
    steps: list[tuple[str, str, int, int]] = []
    for i in range(STEPS):
        kw: dict[str, Any] = dict(model=MODEL, input=new_input, instructions=instructions, tools=RESPONSES_TOOLS,
                                  tool_choice="none", max_output_tokens=12, temperature=0, extra_body=NO_THINKING)
        if prev is not None:
            kw["previous_response_id"] = prev.id
        if stream:
            async with oc.responses.with_streaming_response.create(stream=True, **kw) as raw:
                events = [json.loads(line[5:]) async for line in raw.iter_lines() if line.startswith("data:")]
                headers = raw.headers
            assert events[-1]["type"] in ("response.completed", "response.incomplete"), events[-1]
            r = openai.types.responses.Response.model_validate(events[-1]["response"])
        else:
            got = await oc.responses.with_raw_response.create(**kw)
            r, headers = got.parse(), got.headers
        assert r.usage is not None and r.output and (prev is None or r.previous_response_id == prev.id)
        steps.append((headers["x-kvgate-worker"], headers["x-kvgate-conversation-id"],
                      r.usage.input_tokens_details.cached_tokens, int(headers["x-kvgate-expected-cached-tokens"])))
        prev = r
        call = f"call_{uuid.uuid4().hex[:12]}"
        new_input = [{"type": "function_call", "call_id": call, "name": "search",
                      "arguments": json.dumps({"query": f"cache bug {i}"})},
                     {"type": "function_call_output", "call_id": call, "output": tool_output(i)}]
        await settle()
    await check(gateway, steps, 3, generation_prompt_tokens(pair.model))  # the answer, its function_call, output
    # The stored response: retrieved as it was answered, its own input items listed, and continued once
    # more (the conversation record rebuilds the whole history from the id alone).
    assert (await oc.responses.retrieve(prev.id)).output == prev.output
    items = await oc.responses.input_items.list(prev.id)
    assert sorted(i.type for i in items.data) == ["function_call", "function_call_output"]
    raw = await oc.responses.with_raw_response.create(
        model=MODEL, input="now summarise", previous_response_id=prev.id, instructions=instructions,
        tools=RESPONSES_TOOLS, tool_choice="none", max_output_tokens=4, temperature=0, extra_body=NO_THINKING)
    more = raw.parse()
    assert more.usage is not None and more.previous_response_id == prev.id
    cached = more.usage.input_tokens_details.cached_tokens
    assert cached == int(raw.headers["x-kvgate-expected-cached-tokens"]) and cached > steps[-1][2]
    assert raw.headers["x-kvgate-worker"] == steps[0][0]
    await oc.close()


@pytest.mark.parametrize("stream", [False, True], ids=["create", "stream"])
async def test_messages_tool_loop_on_real_vllm(gateway: ServerHandle, pair: Pair, stream: bool) -> None:
    session = f"cc-real-{uuid.uuid4().hex[:8]}"
    async with anthropic.AsyncAnthropic(base_url=gateway.url, api_key="x", max_retries=0, timeout=120) as ac:
        sys_prompt = system()
        msgs: list[Any] = [{"role": "user", "content": "find the cache bug"}]
        steps: list[tuple[str, str, int, int]] = []
        for i in range(STEPS):
            kw: dict[str, Any] = dict(model=MODEL, max_tokens=12, system=sys_prompt, messages=msgs,
                                      tools=MESSAGES_TOOLS, tool_choice={"type": "none"},
                                      thinking={"type": "disabled"},
                                      extra_headers={"x-claude-code-session-id": session},
                                      extra_body={"temperature": 0})
            if stream:
                async with ac.messages.stream(**kw) as s:
                    msg = await s.get_final_message()
                    headers = s.response.headers
            else:
                raw = await ac.messages.with_raw_response.create(**kw)
                msg, headers = await raw.parse(), raw.headers
            assert headers["x-kvgate-conversation-source"] == "header:x-claude-code-session-id"
            steps.append((headers["x-kvgate-worker"], headers["x-kvgate-conversation-id"],
                          msg.usage.cache_read_input_tokens or 0, int(headers["x-kvgate-expected-cached-tokens"])))
            # Anthropic's uncached input: the prompt less what was read from the cache.
            assert msg.usage.input_tokens > 0 and msg.usage.cache_creation_input_tokens == 0
            use = f"toolu_{uuid.uuid4().hex[:12]}"
            blocks = [b.model_dump(exclude_none=True) for b in msg.content]
            msgs += [{"role": "assistant", "content": [*blocks, {"type": "tool_use", "id": use, "name": "search",
                                                                 "input": {"query": f"cache bug {i}"}}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use,
                                                   "content": tool_output(i)}]}]
            await settle()
    await check(gateway, steps, 2, generation_prompt_tokens(pair.model))  # the answer + tool_use, tool_result
