"""The simulated worker speaks vLLM's wire format: endpoints, usage, streaming, metrics, errors."""

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvgate.serving import ServerHandle, start_server
from kvgate.sim.server import SimWorker
from kvgate.sim.settings import SimSettings
from kvgate.tokens.tokenizer import ChatTokenizer

TOOLS = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]


@pytest.fixture
async def sim(model_dir: Path) -> AsyncIterator[tuple[SimWorker, str]]:
    w = SimWorker(SimSettings(model_dir=str(model_dir), speed=50, hash_seed="0"))
    h: ServerHandle = await start_server(w.build_app())
    yield w, h.url
    await h.stop()


async def post(url: str, path: str, body: Any) -> httpx.Response:
    async with httpx.AsyncClient(timeout=30) as c:
        return await c.post(url + path, json=body)


async def test_tokenize_equals_local_rendering(sim: tuple[SimWorker, str], tokenizer: ChatTokenizer) -> None:
    _, url = sim
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "find the cache"}]
    r = await post(url, "/tokenize", {"model": "kvgate-tiny", "messages": msgs, "tools": TOOLS})
    assert r.status_code == 200
    assert r.json()["tokens"] == tokenizer.encode_chat(msgs, TOOLS)
    d = await post(url, "/detokenize", {"model": "kvgate-tiny", "tokens": r.json()["tokens"]})
    assert d.json()["prompt"] == tokenizer.render_chat(msgs, TOOLS)


async def test_stream_and_non_stream_agree(sim: tuple[SimWorker, str]) -> None:
    _, url = sim
    body = {"model": "kvgate-tiny", "messages": [{"role": "user", "content": "look it up"}], "tools": TOOLS,
            "sim": {"reasoning_tokens": 10, "seed": 1}}
    full = (await post(url, "/v1/chat/completions", body)).json()
    msg = full["choices"][0]["message"]
    assert full["choices"][0]["finish_reason"] == "tool_calls"
    assert msg["reasoning"] and msg["tool_calls"][0]["function"]["name"] == "search"
    reasoning, calls, usage = "", [], None
    async with httpx.AsyncClient() as c, c.stream(
            "POST", url + "/v1/chat/completions",
            json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        import json

        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                obj = json.loads(line[6:])
                if obj["choices"]:
                    d = obj["choices"][0]["delta"]
                    reasoning += d.get("reasoning", "")
                    calls += d.get("tool_calls", [])
                else:
                    usage = obj["usage"]
    assert reasoning == msg["reasoning"]
    assert [c["function"] for c in calls] == [t["function"] for t in msg["tool_calls"]]
    assert usage is not None and usage["completion_tokens"] == full["usage"]["completion_tokens"]
    # The second identical request found the first one's prompt in the prefix cache.
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0


async def test_history_renders_to_the_generated_tokens(sim: tuple[SimWorker, str]) -> None:
    """The assistant message sent back inside a tool chain re-renders byte for byte: the whole previous
    prompt plus generated output (minus the last partial block) is a cache hit."""
    w, url = sim
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "go " * 200}]
    r1 = (await post(url, "/v1/chat/completions", {"model": "kvgate-tiny", "messages": msgs, "tools": TOOLS})).json()
    m = {k: v for k, v in r1["choices"][0]["message"].items() if v is not None}
    msgs += [m, {"role": "tool", "tool_call_id": m["tool_calls"][0]["id"], "content": "result"}]
    r2 = (await post(url, "/v1/chat/completions", {"model": "kvgate-tiny", "messages": msgs, "tools": TOOLS})).json()
    total1 = r1["usage"]["prompt_tokens"] + r1["usage"]["completion_tokens"] - 1  # last token has no KV
    bs = w.profile.block_size
    assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] == total1 // bs * bs


async def test_max_tokens_truncates_with_length(sim: tuple[SimWorker, str]) -> None:
    _, url = sim
    r = await post(url, "/v1/chat/completions", {"model": "kvgate-tiny", "max_tokens": 3,
                                                 "messages": [{"role": "user", "content": "x"}]})
    j = r.json()
    assert j["choices"][0]["finish_reason"] == "length" and j["usage"]["completion_tokens"] == 3


async def test_completions_with_token_ids(sim: tuple[SimWorker, str]) -> None:
    _, url = sim
    r = await post(url, "/v1/completions", {"model": "kvgate-tiny", "prompt": list(range(10, 300)), "max_tokens": 1})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 290


@pytest.mark.parametrize(("path", "body", "status", "param"), [
    ("/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "x"}]}, 404, "model"),
    ("/v1/chat/completions", {"model": "kvgate-tiny", "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": "kvgate-tiny", "messages": [{"role": "user", "content": "x"}],
                              "max_tokens": 5000}, 400, "max_tokens"),
    ("/v1/chat/completions", {"model": "kvgate-tiny", "messages": [{"role": "user", "content": "x"}],
                              "sim": {"reasoning_tokens": -1}}, 400, "sim"),
    ("/v1/completions", {"model": "kvgate-tiny", "prompt": [1, 10**9]}, 400, "prompt"),
])
async def test_bad_requests(sim: tuple[SimWorker, str], path: str, body: Any, status: int, param: str) -> None:
    _, url = sim
    r = await post(url, path, body)
    assert r.status_code == status
    assert r.json()["error"]["param"] == param and r.json()["error"]["code"] == status


async def test_metrics_use_vllm_names(sim: tuple[SimWorker, str]) -> None:
    _, url = sim
    await post(url, "/v1/completions", {"model": "kvgate-tiny", "prompt": list(range(10, 600)), "max_tokens": 2})
    await post(url, "/v1/completions", {"model": "kvgate-tiny", "prompt": list(range(10, 600)), "max_tokens": 2})
    async with httpx.AsyncClient() as c:
        text = (await c.get(url + "/metrics")).text
    samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
               if "source" not in s.labels and "finished_reason" not in s.labels}
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert name in samples
    assert samples["vllm:prefix_cache_queries_total"] == 2 * 590
    assert samples["vllm:prefix_cache_hits_total"] == 512  # 4 blocks of 128; the 5th is partial
    assert samples["vllm:prompt_tokens_cached_total"] == 512


async def test_unknown_fields_are_noted_not_rejected(sim: tuple[SimWorker, str]) -> None:
    w, url = sim
    r = await post(url, "/v1/chat/completions", {"model": "kvgate-tiny", "messages": [{"role": "user", "content": "x"}],
                                                 "my_extension": {"a": 1}})
    assert r.status_code == 200 and w.ignored_fields == ["my_extension"]
