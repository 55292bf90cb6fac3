"""The gateway's metrics for agents: definitions, labels, and what the request path records."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import generate_latest

from kvgate.assembly import create_app
from kvgate.config import GatewaySettings, WorkerConfig
from kvgate.gateway.cardinality import NO_TENANT, OTHER
from kvgate.gateway.telemetry import GatewayMetrics, kv_bytes_per_token
from kvgate.serving import start_server
from tests.conftest import MODEL, Cluster, free_port
from tests.helpers import TINY_KV_BYTES, eventually, metric, model_dir_with_config, start_sims


def test_kv_bytes_per_token_from_the_model_config(model_dir: Path, tmp_path: Path) -> None:
    assert kv_bytes_per_token(model_dir_with_config(model_dir, tmp_path / "tiny")) == TINY_KV_BYTES
    assert kv_bytes_per_token(model_dir) is None  # a tokenizer alone says nothing of the KV
    llama8b = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096,
               "torch_dtype": "bfloat16"}
    mla = {"num_hidden_layers": 61, "num_attention_heads": 128, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
           "hidden_size": 7168, "torch_dtype": "bfloat16"}
    wrapped = {"text_config": {**llama8b, "torch_dtype": "float32"}}
    for name, cfg, want in (("llama", llama8b, 131_072), ("mla", mla, 61 * 576 * 2), ("wrapped", wrapped, 262_144),
                            ("broken", {"num_hidden_layers": "x"}, None)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(cfg))
        assert kv_bytes_per_token(tmp_path / name) == want, name
    assert kv_bytes_per_token(tmp_path / "absent") is None


def samples(m: GatewayMetrics, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(generate_latest(m.registry).decode()):
        for s in fam.samples:
            if s.name == name:
                out[tuple(sorted(s.labels.items()))] = s.value
    return out


def test_itl_per_event_and_tpot_per_stream() -> None:
    m = GatewayMetrics()
    d = m.decode_timing("m", first_output_at=10.0)
    for t in (10.1, 10.3, 10.6):
        d.token(t)
    m.observe_tpot("m", d, completion_tokens=4)
    assert samples(m, "kvgate_inter_token_latency_seconds_count") == {(("model_name", "m"),): 3}
    assert samples(m, "kvgate_inter_token_latency_seconds_sum")[(("model_name", "m"),)] == pytest.approx(0.6)
    assert samples(m, "kvgate_time_per_output_token_seconds_sum")[(("model_name", "m"),)] == pytest.approx(0.2)
    # One event carrying the whole output has no decode timing to speak of.
    m.observe_tpot("m", m.decode_timing("m", 20.0), completion_tokens=50)
    assert samples(m, "kvgate_time_per_output_token_seconds_count")[(("model_name", "m"),)] == 1


def test_a_tenant_that_leaves_the_top_n_leaves_the_exposition() -> None:
    t = [0.0]
    m = GatewayMetrics(top_tenants=1, now=lambda: t[0])
    m.add_cached_input("m", "small", 100)
    m.observe_ttft("m", "small", 0.1)
    m.add_cached_input("m", "", 5)
    for _ in range(10):
        m.add_uncached_prefill("m", "big", 1000)
    assert {dict(k)["tenant"] for k in samples(m, "kvgate_uncached_prefill_tokens_total")} == {OTHER}
    t[0] = 60.0  # a refresh: big sent 100x what small did
    m.add_uncached_prefill("m", "big", 1000)
    cached = samples(m, "kvgate_cached_input_tokens_total")
    assert {dict(k)["tenant"] for k in cached} == {NO_TENANT}  # small's series went with its label
    assert not any(dict(k).get("tenant") == "small" for k in samples(m, "kvgate_ttft_seconds_count"))
    assert samples(m, "kvgate_uncached_prefill_tokens_total")[(("model_name", "m"), ("tenant", "big"))] == 1000
    m.add_cached_input("m", "small", 7)
    assert samples(m, "kvgate_cached_input_tokens_total")[(("model_name", "m"), ("tenant", OTHER))] == 7


async def stream_chat(c: Cluster, conv: str, messages: list[dict[str, Any]], tenant: str | None,
                      sim: dict[str, Any]) -> tuple[httpx.Headers, dict[str, Any], dict[str, Any]]:
    """One streamed turn, read as an agent would: the reply message, the usage, the response headers."""
    headers = {"x-conversation-id": conv, **({"x-tenant-id": tenant} if tenant else {})}
    body = {"model": MODEL, "messages": messages, "stream": True, "stream_options": {"include_usage": True},
            "sim": sim}
    msg: dict[str, Any] = {"role": "assistant", "content": "", "reasoning": ""}
    usage: dict[str, Any] = {}
    async with httpx.AsyncClient(timeout=30) as h, h.stream("POST", c.url + "/v1/chat/completions", json=body,
                                                             headers=headers) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            usage = ev.get("usage") or usage
            for ch in ev.get("choices") or []:
                for k in ("content", "reasoning"):
                    msg[k] += ch["delta"].get(k) or ""
    return r.headers, {k: v for k, v in msg.items() if v}, usage


async def test_the_agent_quantities_through_the_gateway(make_cluster: Any, model_dir: Path, tmp_path: Path) -> None:
    c = await make_cluster(1, events=True, tokenizers={MODEL: str(model_dir_with_config(model_dir, tmp_path / "m"))})
    await eventually(lambda: len(c.gateway.prefix.events.workers()) == 1)
    usages: list[tuple[str, dict[str, Any]]] = []
    recomputed = 0
    for conv, tenant in (("a1", "acme"), ("a2", "acme"), ("n1", None)):
        msgs: list[dict[str, Any]] = [{"role": "system", "content": "agent " * 150},
                                      {"role": "user", "content": f"task {conv}"}]
        for turn in range(2):
            hdr, reply, usage = await stream_chat(c, conv, msgs, tenant, {"tool_calls": 0, "reasoning_tokens": 120,
                                                                          "answer_tokens": 12})
            usages.append((tenant or NO_TENANT, usage))
            if turn == 1:  # a new user turn: the template dropped the reasoning the cached chain holds
                reuse = dict(kv.split("=", 1) for kv in hdr["x-kvgate-prefix-reuse"].split("; "))
                assert reuse["cause"] == "reasoning_dropped" and int(reuse["lost"]) > 0
                recomputed += int(reuse["lost"]) if tenant else 0
            msgs += [reply, {"role": "user", "content": "and then?"}]
    acme = [u for t, u in usages if t == "acme"]
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in acme)
    assert cached > 0
    labels = {"model_name": MODEL, "tenant": "acme"}
    assert await metric(c, "kvgate_cached_input_tokens_total", **labels) == cached
    assert await metric(c, "kvgate_uncached_prefill_tokens_total", **labels) == \
        sum(u["prompt_tokens"] for u in acme) - cached
    assert await metric(c, "kvgate_recomputed_history_tokens_total", **labels) == recomputed
    assert await metric(c, "kvgate_ttft_seconds_count", **labels) == 4
    assert await metric(c, "kvgate_ttft_seconds_count", model_name=MODEL, tenant=NO_TENANT) == 2
    # Per-token timing: every stream had ~130 output events after its first.
    assert await metric(c, "kvgate_inter_token_latency_seconds_count", model_name=MODEL) >= 6 * 100
    assert await metric(c, "kvgate_time_per_output_token_seconds_count", model_name=MODEL) == 6
    contexts = [u["prompt_tokens"] + u["completion_tokens"] for _, u in usages]
    assert await metric(c, "kvgate_session_active_context_tokens_sum", model_name=MODEL) == sum(contexts)
    bs = c.sims[0][0].profile.block_size
    assert await metric(c, "kvgate_session_kv_bytes_sum", model_name=MODEL) == \
        sum(-(-n // bs) * bs * TINY_KV_BYTES for n in contexts)
    assert round(await metric(c, "kvgate_active_conversations", model_name=MODEL)) == 3
    assert await metric(c, "kvgate_requests_total", endpoint="chat", status="200") == 6
    # The same figures per conversation, in its record.
    per_conv = {"acme/a1": usages[0:2], "acme/a2": usages[2:4], "n1": usages[4:6]}
    recomputed_seen = 0
    async with httpx.AsyncClient() as h:
        for cid, us in per_conv.items():
            rec = (await h.get(f"{c.url}/admin/conversations/{cid}")).json()
            am = rec["agent_metrics"]
            got = [u for _, u in us]
            assert am["turns"] == 2 and am["prompt_tokens"] == sum(u["prompt_tokens"] for u in got)
            assert am["cached_input_tokens"] == sum(u["prompt_tokens_details"]["cached_tokens"] for u in got)
            assert am["uncached_prefill_tokens"] == am["prompt_tokens"] - am["cached_input_tokens"]
            last = got[-1]["prompt_tokens"] + got[-1]["completion_tokens"]
            assert am["active_context_tokens"] == last and am["kv_bytes"] == -(-last // bs) * bs * TINY_KV_BYTES
            assert am["ttft_s"]["mean"] > 0 and am["ttft_s"]["last"] == rec["turns"][-1]["ttft_s"]
            assert am["tpot_s"]["mean"] > 0 and am["tpot_s"]["max"] >= am["tpot_s"]["p50"]
            assert [t["recomputed_tokens"] > 0 for t in rec["turns"]] == [False, True]
            assert [t["uncached_prefill_tokens"] for t in rec["turns"]] == \
                [u["prompt_tokens"] - u["prompt_tokens_details"]["cached_tokens"] for u in got]
            recomputed_seen += am["recomputed_history_tokens"] if cid.startswith("acme/") else 0
    assert recomputed_seen == recomputed


async def test_an_abandoned_stream_is_counted_as_499(make_cluster: Any) -> None:
    c = await make_cluster(1, sim={"speed": 1.0, "profile": "cpu-tiny"})
    body = {"model": MODEL, "messages": [{"role": "user", "content": "long"}], "stream": True,
            "sim": {"reasoning_tokens": 2000, "answer_tokens": 10}}
    async with httpx.AsyncClient() as h, h.stream("POST", c.url + "/v1/chat/completions", json=body) as r:
        async for line in r.aiter_lines():
            if '"reasoning"' in line:
                break  # the client walks away mid-stream
    await eventually(lambda: c.gateway.pool.all()[0].in_flight == 0)
    async def abandoned() -> bool:
        return await metric(c, "kvgate_requests_total", status="499") == 1

    await eventually(abandoned)
    assert await metric(c, "kvgate_requests_total", status="200") == 0


async def test_a_stream_whose_worker_dies_is_counted_as_502(spawn: Any, model_dir: Path) -> None:
    sims = await start_sims(spawn, model_dir, 1, "--speed", "1", "--profile", "cpu-tiny")
    gw = await start_server(create_app(GatewaySettings(workers=[WorkerConfig(url=sims[0][1], model=MODEL,
                                                                             engine="sim")], health_interval_s=30)))
    try:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream": True,
                "sim": {"reasoning_tokens": 2000}}
        async with httpx.AsyncClient(timeout=30) as h, h.stream("POST", gw.url + "/v1/chat/completions",
                                                                json=body) as r:
            n = 0
            async for line in r.aiter_lines():
                n += line.startswith("data: ")
                if n == 3:
                    sims[0][0].signal(signal.SIGKILL)
        c = type("C", (), {"url": gw.url})()
        assert await metric(c, "kvgate_requests_total", status="502") == 1  # type: ignore[arg-type]
        assert await metric(c, "kvgate_requests_total", status="200") == 0  # type: ignore[arg-type]
    finally:
        await gw.stop()


async def test_a_scrape_asks_the_session_store_nothing(make_cluster: Any) -> None:
    # A Redis nobody listens on: any store call on a scrape would count an error.
    c = await make_cluster(1, session_store="redis", redis_url=f"redis://127.0.0.1:{free_port()}/0")
    await c.gateway.runtime.aclose()  # its timer ticks ask the fleet store; the scrape must not
    before = await metric(c, "kvgate_session_store_errors_total")
    for _ in range(3):
        assert await metric(c, "kvgate_session_store_errors_total") == before
    assert "kvgate_sessions " not in (await httpx.AsyncClient().get(c.url + "/metrics")).text
