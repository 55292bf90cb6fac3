"""Traces: one agent turn through a real gateway and simulated workers, collected with the SDK's in-memory
exporter; the worker's view of ``traceparent``; background prefill traces; sampling; configuration."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF
from opentelemetry.trace import SpanKind, StatusCode

from kvgate.assembly import create_app
from kvgate.config import GatewaySettings, WorkerConfig
from kvgate.gateway.tracing import Tracing, provider_from_env
from kvgate.serving import ServerHandle, start_server
from kvgate.session.prefill import PrefillParams
from kvgate.sim.server import SimWorker
from kvgate.sim.settings import SimSettings
from tests.conftest import MODEL
from tests.helpers import TOOLS, eventually

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
PREPARE_STEPS = ["identify", "canonicalise", "tokenize", "session"]


class HeaderTap:
    """A simulated worker's ASGI app, noting the trace headers of every completion request it gets."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.seen: list[tuple[str, str]] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            h = dict(scope["headers"])
            self.seen.append((scope["path"], h.get(b"traceparent", b"").decode()))
        await self.app(scope, receive, send)


@dataclass
class Traced:
    url: str
    exporter: InMemorySpanExporter
    taps: list[HeaderTap]
    handles: list[ServerHandle] = field(default_factory=list)

    def spans(self) -> list[ReadableSpan]:
        return list(self.exporter.get_finished_spans())

    def worker_traceparents(self, path: str = "/v1/chat/completions") -> list[str]:
        return [tp for t in self.taps for p, tp in t.seen if p == path]


@pytest.fixture
async def traced(model_dir: Path) -> AsyncIterator[Any]:
    made: list[Traced] = []

    async def make(provider: TracerProvider | None = None, exporter: InMemorySpanExporter | None = None,
                   off: bool = False, **gw: Any) -> Traced:
        if exporter is None:
            exporter = InMemorySpanExporter()
        if provider is None:
            provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        taps, handles = [], []
        bs = 16
        for _ in range(2):
            w = SimWorker(SimSettings(model_dir=str(model_dir), hash_seed="0", speed=20.0))
            tap = HeaderTap(w.build_app())
            taps.append(tap)
            bs = w.profile.block_size
            handles.append(await start_server(tap))
        settings = GatewaySettings(
            workers=[WorkerConfig(url=h.url, model=MODEL, engine="sim", block_size=bs) for h in handles],
            tokenizers={MODEL: str(model_dir)}, hash_seed="0", health_interval_s=0.2, **gw)
        gw_handle = await start_server(create_app(settings, tracing=Tracing(None if off else provider)))
        t = Traced(gw_handle.url, exporter, taps, [gw_handle, *handles])
        made.append(t)
        return t

    yield make
    for t in made:
        for h in t.handles:
            await h.stop()


async def chat(url: str, messages: list[dict[str, Any]], headers: dict[str, str], **sim: Any) -> dict[str, Any]:
    """One streamed chat request; returns the assembled message, its usage and the response headers."""
    body = {"model": MODEL, "messages": messages, "tools": TOOLS, "stream": True,
            "stream_options": {"include_usage": True}, "sim": {"reasoning_tokens": 20, **sim}}
    msg: dict[str, Any] = {"role": "assistant", "content": "", "reasoning": ""}
    calls: list[dict[str, Any]] = []
    usage: dict[str, Any] = {}
    async with httpx.AsyncClient(timeout=30) as h, h.stream("POST", url + "/v1/chat/completions", json=body,
                                                             headers=headers) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            usage = obj.get("usage") or usage
            for ch in obj.get("choices", []):
                d = ch.get("delta", {})
                msg["content"] += d.get("content") or ""
                msg["reasoning"] += d.get("reasoning") or ""
                for tc in d.get("tool_calls") or []:
                    calls.append({"id": tc["id"], "type": "function", "function": tc["function"]})
        resp_headers = dict(r.headers)
    if calls:
        msg["tool_calls"] = calls
    return {"message": msg, "usage": usage, "headers": resp_headers}


def by_trace(spans: list[ReadableSpan], trace_id: int) -> dict[str, list[ReadableSpan]]:
    out: dict[str, list[ReadableSpan]] = {}
    for s in spans:
        if s.context is not None and s.context.trace_id == trace_id:
            out.setdefault(s.name, []).append(s)
    return out


def one(spans: dict[str, list[ReadableSpan]], name: str) -> ReadableSpan:
    assert len(spans.get(name, [])) == 1, (name, sorted(spans))
    return spans[name][0]


async def test_an_agent_turn_is_one_trace_from_client_to_worker(traced: Any) -> None:
    t = await traced()
    conv = {"x-conversation-id": "traced-agent", "x-tenant-id": "acme",
            "traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"}
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "You are an agent. " * 30},
                                  {"role": "user", "content": "find the bug"}]
    first = await chat(t.url, msgs, conv, tool_calls=1)
    msgs += [first["message"], {"role": "tool", "tool_call_id": first["message"]["tool_calls"][0]["id"],
                                "content": "line of output " * 20}]
    second = await chat(t.url, msgs, conv, tool_calls=0)  # the agent turn ends with an answer
    await eventually(lambda: len([s for s in t.spans() if s.name.startswith("POST")]) == 2)

    spans = t.spans()
    roots = sorted((s for s in spans if s.name == "POST /v1/chat/completions"), key=lambda s: s.start_time or 0)
    assert len(roots) == 2
    for root, resp in zip(roots, (first, second), strict=True):
        # The client's trace continues: same trace id, the client's span as parent.
        assert root.kind is SpanKind.SERVER and f"{root.context.trace_id:032x}" == CLIENT_TRACE
        assert root.parent is not None and f"{root.parent.span_id:016x}" == CLIENT_SPAN
        assert root.attributes["gen_ai.conversation.id"] == "acme/traced-agent"  # ids are per tenant
        assert root.attributes["gen_ai.operation.name"] == "chat"
        assert root.attributes["http.response.status_code"] == 200
        kids = {s.name: s for s in spans if s.parent is not None and s.parent.span_id == root.context.span_id}
        assert set(kids) == {*PREPARE_STEPS, "route", f"chat {MODEL}", "relay", "record"}
        order = [*PREPARE_STEPS, "route", f"chat {MODEL}", "relay", "record"]
        starts = [kids[n].start_time or 0 for n in order]
        assert starts == sorted(starts), order
        assert all((k.end_time or 0) <= (root.end_time or 0) for k in kids.values())

        route = kids["route"].attributes
        worker = resp["headers"]["x-kvgate-worker"]
        assert route["kvgate.route.policy"] == "cost_model" and route["kvgate.route.worker"] == worker
        assert route["kvgate.route.reason"] == resp["headers"]["x-kvgate-route-reason"].split(":")[1]
        assert route["kvgate.route.tier"] == resp["headers"]["x-kvgate-route-tier"]
        expected = int(resp["headers"]["x-kvgate-expected-cached-tokens"])
        assert route["kvgate.route.expected_cached_tokens"] == expected
        assert route["kvgate.route.expected_cached_tokens.gpu"] + route["kvgate.route.expected_cached_tokens.cpu"] \
            + route["kvgate.route.expected_cached_tokens.remote"] == expected
        assert route["kvgate.route.runner_up"] != worker and route["kvgate.route.runner_up_score_ms"] >= 0

        up = kids[f"chat {MODEL}"]
        assert up.kind is SpanKind.CLIENT
        a = up.attributes
        assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.request.model"] == MODEL
        assert a["gen_ai.provider.name"] == "sim" and a["kvgate.worker"] == worker
        assert a["gen_ai.usage.input_tokens"] == resp["usage"]["prompt_tokens"]
        assert a["gen_ai.usage.output_tokens"] == resp["usage"]["completion_tokens"]
        assert a["gen_ai.usage.cache_read.input_tokens"] == resp["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert a["server.address"] == "127.0.0.1"
        ttft = [e for e in up.events if e.name == "first_token"]
        assert len(ttft) == 1 and ttft[0].attributes["kvgate.ttft_s"] == a["gen_ai.response.time_to_first_chunk"] > 0
        # The worker got the worker call's own context: its spans (vLLM's llm_request) join under it.
        assert f"00-{CLIENT_TRACE}-{up.context.span_id:016x}-01" in t.worker_traceparents()

        assert kids["tokenize"].attributes["kvgate.prompt.tokens"] == resp["usage"]["prompt_tokens"]
        assert kids["tokenize"].attributes["kvgate.prompt.tokenizer"] == "local"
        assert kids["identify"].attributes["kvgate.tenant"] == "acme"
        assert kids["relay"].attributes["kvgate.relay.outcome"] == "done"
        assert kids["record"].attributes["kvgate.turn.cached_tokens"] == \
            resp["usage"]["prompt_tokens_details"]["cached_tokens"]
    first_up = [s for s in spans if s.name == f"chat {MODEL}" and s.parent == roots[0].context]
    assert first_up[0].attributes["gen_ai.response.finish_reasons"] == ("tool_calls",)
    assert roots[1].start_time is not None and roots[0].end_time is not None
    assert roots[1].start_time > roots[0].end_time

    # The conversation's record names each turn's trace.
    async with httpx.AsyncClient() as h:
        rec = (await h.get(t.url + "/admin/conversations/acme/traced-agent")).json()
    assert [(x["trace_id"], x["span_id"]) for x in rec["turns"]] == \
        [(CLIENT_TRACE, f"{r.context.span_id:016x}") for r in roots]


async def test_a_rejected_request_is_traced_with_its_error(traced: Any) -> None:
    t = await traced()
    async with httpx.AsyncClient() as h:
        r = await h.post(t.url + "/v1/chat/completions", json={"model": MODEL, "messages": [
            {"role": "user", "content": "hi"}]}, headers={"x-conversation-id": "bad id"})
    assert r.status_code == 400
    await eventually(lambda: any(s.name.startswith("POST") for s in t.spans()))
    spans = t.spans()
    root = next(s for s in spans if s.name.startswith("POST"))
    assert root.parent is None  # no incoming traceparent: a trace of its own
    assert root.attributes["http.response.status_code"] == 400
    assert root.status.status_code is StatusCode.UNSET  # a client's error is not the server's
    identify = next(s for s in spans if s.name == "identify")
    assert identify.status.status_code is StatusCode.ERROR


async def test_background_prefill_is_its_own_trace_linked_to_the_turn(traced: Any) -> None:
    t = await traced(reasoning_policy="drop", prefill=PrefillParams(min_gain_tokens=128, min_continue=0.5),
                     timer_tick_s=0.05)
    conv = {"x-conversation-id": "bg-agent"}
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "You are an agent. " * 30},
                                  {"role": "user", "content": "explain"}]
    # A tool step with long reasoning, then the answer: the next turn drops that reasoning, so the
    # canonical prefix is worth prefilling.
    step = (await chat(t.url, msgs, conv, tool_calls=1, reasoning_tokens=400))["message"]
    msgs += [step, {"role": "tool", "tool_call_id": step["tool_calls"][0]["id"], "content": "result " * 150}]
    await chat(t.url, msgs, conv, tool_calls=0, reasoning_tokens=100, answer_tokens=40)
    await eventually(lambda: any(s.name == "kvgate prefill" for s in t.spans()), timeout_s=10)
    await eventually(lambda: t.worker_traceparents("/v1/completions") != [], timeout_s=10)
    spans = t.spans()
    root = max((s for s in spans if s.name == "POST /v1/chat/completions"), key=lambda s: s.start_time or 0)
    bg = next(s for s in spans if s.name == "kvgate prefill")
    assert bg.parent is None and bg.context.trace_id != root.context.trace_id
    assert [link.context.span_id for link in bg.links] == [root.context.span_id]
    assert bg.attributes["gen_ai.conversation.id"] == "bg-agent"
    assert bg.attributes["kvgate.prefill.decision"] == "issued"
    await eventually(lambda: any(s.name == "prefill request" for s in t.spans()), timeout_s=10)
    req = next(s for s in t.spans() if s.name == "prefill request")
    assert req.kind is SpanKind.CLIENT and req.parent is not None and req.parent.span_id == bg.context.span_id
    [tp] = t.worker_traceparents("/v1/completions")
    assert tp[:-2] == f"00-{bg.context.trace_id:032x}-{req.context.span_id:016x}-" and int(tp[-2:], 16) & 1


async def test_unsampled_requests_record_nothing_and_keep_the_trace_id(traced: Any) -> None:
    t = await traced(provider=TracerProvider(sampler=ALWAYS_OFF))
    await chat(t.url, [{"role": "user", "content": "hi"}], {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"})
    await asyncio.sleep(0.2)
    assert t.spans() == []
    [tp] = t.worker_traceparents()
    assert tp.startswith(f"00-{CLIENT_TRACE}-") and tp.endswith("-00") and CLIENT_SPAN not in tp


async def test_tracing_off_forwards_the_clients_traceparent_unchanged(traced: Any) -> None:
    t = await traced(off=True)
    tp = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
    await chat(t.url, [{"role": "user", "content": "hi"}], {"traceparent": tp})
    await chat(t.url, [{"role": "user", "content": "hi"}], {})
    assert t.worker_traceparents() == [tp, ""]
    assert t.spans() == []


def test_configuration_from_the_standard_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in ("OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES", "OTEL_TRACES_SAMPLER", "OTEL_TRACES_SAMPLER_ARG"):
        monkeypatch.delenv(k, raising=False)
    assert provider_from_env({}) is None
    assert provider_from_env({"OTEL_TRACES_EXPORTER": "none"}) is None
    assert provider_from_env({"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "console"}) is None
    p = provider_from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"})
    assert p is not None
    procs = p._active_span_processor._span_processors  # type: ignore[attr-defined]
    assert [type(x) for x in procs] == [BatchSpanProcessor]
    assert type(procs[0].span_exporter).__module__ == "opentelemetry.exporter.otlp.proto.http.trace_exporter"
    assert p.resource.attributes["service.name"] == "kvgate"
    p.shutdown()
    monkeypatch.setenv("OTEL_SERVICE_NAME", "gw-eu")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0.25")
    p = provider_from_env({"OTEL_TRACES_EXPORTER": "console"})
    assert p is not None and p.resource.attributes["service.name"] == "gw-eu"
    assert "0.25" in p.sampler.get_description()
    p.shutdown()
    with pytest.raises(ValueError, match="otlp, console and none"):
        provider_from_env({"OTEL_TRACES_EXPORTER": "zipkin"})
    with pytest.raises(ValueError, match="grpc or http/protobuf"):
        provider_from_env({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"})
