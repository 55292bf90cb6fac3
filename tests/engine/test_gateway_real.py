"""The gateway in front of two real vLLM workers."""

from __future__ import annotations

from collections import Counter
from typing import Any

import openai

from kvgate.config import GatewaySettings, WorkerConfig
from kvgate.gateway.app import create_app
from kvgate.serving import start_server
from tests.engine.conftest import Pair

SYSTEM = "You are a careful coding agent. Read the repository before you change anything. " * 20


async def test_sessions_stick_reuse_cache_and_spread(pair: Pair) -> None:
    settings = GatewaySettings(workers=[WorkerConfig(url=w.url, model="kvgate-tiny", engine="vllm")
                                        for w in (pair.a, pair.b)], health_interval_s=1.0)
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
        # Many conversations with the same system prompt are spread, not piled on the worker that has it.
        placed = Counter()
        for s in range(8):
            raw = await oc.chat.completions.with_raw_response.create(
                model="kvgate-tiny", messages=[{"role": "system", "content": SYSTEM},
                                               {"role": "user", "content": f"session {s}"}],
                max_tokens=2, extra_headers={"x-conversation-id": f"spread-{s}"})
            placed[raw.headers["x-kvgate-worker"]] += 1
        assert len(placed) == 2 and min(placed.values()) >= 2
    finally:
        await gw.stop()
