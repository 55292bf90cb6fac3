"""The simulated worker in SGLang mode speaks SGLang 0.5.23's wire format: usage with the cache report, flat
errors, /flush_cache, /server_info, ``sglang:`` metrics, signed-int64 KV events, priorities."""

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import msgpack
import pytest
import zmq
import zmq.asyncio
from prometheus_client.parser import text_string_to_metric_families

from kvgate.dev.engines import free_port
from kvgate.router.kvevents import Stored, decode_batch
from kvgate.router.sglang import SglangHasher
from kvgate.serving import ServerHandle, start_server
from kvgate.sim.server import SimWorker
from kvgate.sim.settings import SimSettings


async def _start(model_dir: Path, **kw: Any) -> tuple[SimWorker, ServerHandle]:
    w = SimWorker(SimSettings(model_dir=str(model_dir), speed=50, engine="sglang", **kw))
    return w, await start_server(w.build_app())


@pytest.fixture
async def sim(model_dir: Path) -> AsyncIterator[tuple[SimWorker, str]]:
    w, h = await _start(model_dir, block_size=16)
    yield w, h.url
    await h.stop()


async def post(url: str, path: str, body: Any) -> httpx.Response:
    async with httpx.AsyncClient(timeout=30) as c:
        return await c.post(url + path, json=body)


def prompt(n: int, seed: int = 0) -> list[int]:
    return [(seed * 7919 + i * 31) % 900 + 50 for i in range(n)]


async def test_cached_tokens_are_page_granular_and_reported(sim: tuple[SimWorker, str]) -> None:
    _, url = sim
    p = prompt(100)
    first = (await post(url, "/v1/completions", {"prompt": p, "max_tokens": 2})).json()["usage"]
    assert first["prompt_tokens_details"] == {"cached_tokens": 0} and first["reasoning_tokens"] == 0
    again = (await post(url, "/v1/completions", {"prompt": p + [7] * 20, "max_tokens": 2})).json()["usage"]
    # The first request's prompt (6 full pages) and output (2 tokens, the last without KV: 101 tokens ->
    # 6 pages) are cached; the model name is not checked.
    assert again["prompt_tokens_details"]["cached_tokens"] == 96


async def test_cache_report_off_leaves_details_null(model_dir: Path) -> None:
    _, h = await _start(model_dir, enable_cache_report=False)
    try:
        r = await post(h.url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                       "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens_details"] is None
    finally:
        await h.stop()


@pytest.mark.parametrize(("path", "body", "fragment"), [
    ("/v1/completions", {"prompt": [1, 2], "max_tokens": 0}, "max_tokens must be positive"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": -1},
     "max_new_tokens must be at least 0"),
    ("/v1/completions", {"prompt": [5] * 5000}, "longer than the model's context length"),
])
async def test_errors_are_flat(sim: tuple[SimWorker, str], path: str, body: Any, fragment: str) -> None:
    _, url = sim
    r = await post(url, path, body)
    assert r.status_code == 400
    err = r.json()
    assert err["object"] == "error" and err["code"] == 400 and fragment in err["message"] and "error" not in err


async def test_chat_max_tokens_zero_means_no_limit(sim: tuple[SimWorker, str]) -> None:
    _, url = sim
    r = await post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0,
                                                 "sim": {"reasoning_tokens": 3, "answer_tokens": 3}})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "stop"


async def test_flush_cache_metrics_and_server_info(sim: tuple[SimWorker, str]) -> None:
    w, url = sim
    await post(url, "/v1/completions", {"prompt": prompt(64), "max_tokens": 1})
    async with httpx.AsyncClient() as c:
        text = (await c.get(url + "/metrics")).text
        fams = {s.name: s for f in text_string_to_metric_families(text) for s in f.samples}
        assert fams["sglang:num_running_reqs"].labels["engine_type"] == "unified"
        sources = {s.labels["cache_source"] for f in text_string_to_metric_families(text) for s in f.samples
                   if s.name == "sglang:cached_tokens_total"}
        assert sources == {"device", "host"} and "sglang:hicache_host_total_tokens" not in fams
        assert fams["sglang:token_usage"].value == 0  # cached pages nobody uses count as free
        assert fams["sglang:page_size"].value == 16 and "vllm:num_requests_running" not in fams
        assert w.core.cached_block_count() == 4
        r = await c.get(url + "/flush_cache")
        assert r.status_code == 200 and r.text.startswith("Cache flushed.")
        assert w.core.cached_block_count() == 0
        assert (await c.post(url + "/reset_prefix_cache")).status_code == 404
        info = (await c.get(url + "/server_info")).json()
        assert info["page_size"] == 16 and "kv_events" not in info  # no publisher configured


async def test_flush_is_refused_while_requests_run(sim: tuple[SimWorker, str]) -> None:
    _, url = sim
    task = asyncio.create_task(post(url, "/v1/completions", {"prompt": prompt(30), "max_tokens": 400,
                                                             "ignore_eos": True}))
    await asyncio.sleep(0.2)
    async with httpx.AsyncClient() as c:
        r = await c.post(url + "/flush_cache")
    await task
    assert r.status_code == 400


async def test_kv_events_are_sglangs(model_dir: Path) -> None:
    port, replay = free_port(), free_port()
    _, h = await _start(model_dir, block_size=16, kv_events_endpoint=f"tcp://127.0.0.1:{port}",
                        kv_replay_endpoint=f"tcp://127.0.0.1:{replay}", kv_events_topic="kv")
    ctx = zmq.asyncio.Context()
    sub = ctx.socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{port}")
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    try:
        await asyncio.sleep(0.5)  # a SUB that has not joined yet would miss the batch
        p = prompt(40, 3)
        await post(h.url, "/v1/completions", {"prompt": p, "max_tokens": 1, "cache_salt": "t"})
        topic, seq, payload = await asyncio.wait_for(sub.recv_multipart(), 15)
        (ev,) = msgpack.unpackb(payload)[1]
        hasher = SglangHasher(16)
        assert topic == b"kv" and ev["cache_salt"] == "t" and "group_idx" not in ev and ev["lora_id"] is None
        assert ev["block_hashes"] == hasher.event_ints(hasher.block_hashes(p, cache_salt="t"))
        assert decode_batch(payload) == [Stored(tuple(ev["block_hashes"]), None, "GPU")]
        info = (await httpx.AsyncClient().get(h.url + "/server_info")).json()["kv_events"]
        assert info["endpoint_port_base"] == port and info["replay_endpoint_port_base"] == replay
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{replay}")
        await dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        frames = await asyncio.wait_for(dealer.recv_multipart(), 5)
        assert frames == [b"", b"kv", seq, payload]  # SGLang's replies repeat the topic
        dealer.close(0)
    finally:
        sub.close(0)
        ctx.term()
        await h.stop()


async def test_negative_priority_runs_in_the_background(model_dir: Path) -> None:
    w, h = await _start(model_dir, priority_scheduling=True)
    try:
        seen: list[bool] = []
        orig = w.core.add_request
        w.core.add_request = lambda r: (seen.append(r.background), orig(r))[1]  # type: ignore[method-assign]
        for prio in (-5, 0, 3):
            r = await post(h.url, "/v1/completions", {"prompt": prompt(10), "max_tokens": 1, "priority": prio})
            assert r.status_code == 200
        assert seen == [True, False, False]
    finally:
        await h.stop()


async def test_hicache_host_tier_is_exposed(model_dir: Path) -> None:
    _, h = await _start(model_dir, block_size=16, num_blocks=64, hicache_ratio=2.0)
    try:
        await post(h.url, "/v1/completions", {"prompt": prompt(64), "max_tokens": 1})
        async with httpx.AsyncClient() as c:
            text = (await c.get(h.url + "/metrics")).text
        fams = {s.name: s for f in text_string_to_metric_families(text) for s in f.samples}
        assert fams["sglang:hicache_host_total_tokens"].value == 2048
        assert fams["sglang:hicache_host_used_tokens"].value == 64  # the prompt's 4 pages, written through
    finally:
        await h.stop()


def test_hicache_needs_sglang(model_dir: Path) -> None:
    with pytest.raises(ValueError):
        SimSettings(model_dir=str(model_dir), hicache_ratio=1.0)
