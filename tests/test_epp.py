"""The endpoint picker driven message by message as Envoy's ext_proc filter drives it, through a real gRPC
channel, against a gateway with simulated workers: every answer, header mutation, body mutation and
metadata entry checked. Worker responses are real: the test forwards the mutated request to the picked
simulated worker and feeds its answer back, as Envoy would."""

from __future__ import annotations

import json
from typing import Any

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvgate.epp import protocol as proto
from kvgate.grpc.gen.envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as pm
from kvgate.grpc.gen.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from kvgate.grpc.gen.envoy.service.ext_proc.v3 import external_processor_pb2_grpc as epgrpc
from tests.conftest import MODEL, Cluster
from tests.envoy import apply, destination, request_body, request_headers, response_body, response_headers
from tests.helpers import eventually, metric

SYSTEM = "You are a careful agent. " * 40
CHAT = "/v1/chat/completions"
BUFFERED = ep.ProtocolConfiguration(request_body_mode=pm.ProcessingMode.BUFFERED,
                                    response_body_mode=pm.ProcessingMode.BUFFERED)


def chat_body(user: str = "Where is the bug?", **kw: Any) -> bytes:
    return json.dumps({"model": MODEL, "messages": [{"role": "system", "content": SYSTEM},
                                                    {"role": "user", "content": user}],
                       "max_tokens": 8, "reasoning_policy": "keep", **kw}).encode()


async def setup(make_cluster: Any, **kw: Any) -> tuple[Cluster, grpc.aio.Channel, Any]:
    kw.setdefault("drain_timeout_s", 1)  # a stream a failed test leaves open does not hold the shutdown
    c: Cluster = await make_cluster(2, events=True, epp_port=0, **kw)
    port = c.gateway_handle.server.config.app.state.grpc.epp_port  # type: ignore[union-attr]
    ch = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    return c, ch, epgrpc.ExternalProcessorStub(ch)


def set_headers(m: ep.HeaderMutation) -> dict[str, tuple[str, int]]:
    return {o.header.key: (o.header.raw_value.decode(), o.append_action) for o in m.set_headers}


async def read_body(call: Any) -> bytes:
    """Streamed body responses up to the one with end_of_stream."""
    data = b""
    while True:
        r = await call.read()
        assert r.WhichOneof("response") == "request_body", r
        sr = r.request_body.response.body_mutation.streamed_response
        assert len(sr.body) <= proto.CHUNK
        data += sr.body
        if sr.end_of_stream:
            return data


async def test_full_duplex_chat_request_and_streamed_response(make_cluster: Any) -> None:
    c, ch, stub = await setup(make_cluster, worker={"engine": "vllm"})  # vLLM workers: token ids are asked for
    call = stub.Process()
    raw = chat_body(stream=True)
    await call.write(request_headers(CHAT, {"content-type": "application/json", "content-length": str(len(raw)),
                                            "x-conversation-id": "duplex"}))
    # Envoy streams the body without waiting; the picker answers nothing until the end of the body.
    await call.write(request_body(raw[:100], False))
    await call.write(request_body(raw[100:], True))
    first = await call.read()
    assert first.WhichOneof("response") == "request_headers"
    common = first.request_headers.response
    assert common.clear_route_cache
    hs = set_headers(common.header_mutation)
    picked = hs[proto.DESTINATION][0]
    primary, *fallbacks = picked.split(",")
    workers = {w.id for w in c.gateway.pool.all()}
    assert primary in workers and fallbacks == sorted(workers - {primary})  # epp_fallbacks: 1, next best
    assert destination(first) == picked  # header and envoy.lb metadata name the same endpoints
    assert all(action == 2 for _, action in hs.values())  # OVERWRITE_IF_EXISTS_OR_ADD
    new = await read_body(call)
    assert int(hs["content-length"][0]) == len(new)
    sent = json.loads(new)
    assert "reasoning_policy" not in sent and sent["stream_options"] == {"include_usage": True}  # kvgate asks for usage
    assert sent["return_token_ids"] is True and sent["messages"][1]["content"] == "Where is the bug?"
    assert c.gateway.pool.get(primary).in_flight == 1  # the slot is taken until the response ends
    # The worker's real answer goes back through the picker, as Envoy sends it.
    async with httpx.AsyncClient() as h:
        up = await h.post(f"http://{primary}{CHAT}", content=new, headers={"content-type": "application/json"})
    await call.write(response_headers(200, {"content-type": "text/event-stream"}, served=primary))
    rh = await call.read()
    added = set_headers(rh.response_headers.response.header_mutation)
    assert added["x-kvgate-worker"][0] == primary and added["x-kvgate-conversation-id"][0] == "duplex"
    assert added["x-kvgate-route-reason"][0].startswith("cost_model:")
    chunks = [up.content[i:i + 37] for i in range(0, len(up.content), 37)]
    got = b""
    for part in chunks:
        await call.write(response_body(part, False))
    await call.write(response_body(b"", True))
    while True:
        r = await call.read()
        sr = r.response_body.response.body_mutation.streamed_response
        got += sr.body
        if sr.end_of_stream:
            break
    # The client did not ask for usage: kvgate's usage chunk is kept out; the token ids are removed.
    assert b'"usage"' not in got and b"token_ids" not in got and b"[DONE]" in got
    # The turn was recorded before the last chunk went back.
    conv = await c.gateway.store.peek("duplex")  # type: ignore[arg-type]
    assert conv is not None and conv.turn_count == 1 and conv.turns[0].worker == primary
    assert conv.turns[0].ttft_s is not None and conv.turns[0].prompt_tokens > 0
    assert c.gateway.pool.get(primary).in_flight == 0
    await call.done_writing()
    assert await call.read() == grpc.aio.EOF
    await ch.close()


async def test_buffered_bodies_are_answered_in_the_body_response(make_cluster: Any) -> None:
    c, ch, stub = await setup(make_cluster, worker={"engine": "vllm"})
    call = stub.Process()
    raw = chat_body("Buffered, please.")
    await call.write(request_headers(CHAT, {"content-type": "application/json", "x-conversation-id": "buf"},
                                     config=BUFFERED))
    # BUFFERED: the headers are answered at once, unchanged (the pick needs the body).
    hr = await call.read()
    assert hr.WhichOneof("response") == "request_headers"
    assert not hr.request_headers.response.header_mutation.set_headers
    await call.write(request_body(raw, True))
    br = await call.read()
    assert br.WhichOneof("response") == "request_body"
    common = br.request_body.response
    hs = set_headers(common.header_mutation)
    new = common.body_mutation.body
    assert int(hs["content-length"][0]) == len(new) and "reasoning_policy" not in json.loads(new)
    primary = hs[proto.DESTINATION][0].split(",")[0]
    assert destination(br) == hs[proto.DESTINATION][0] and common.clear_route_cache
    async with httpx.AsyncClient() as h:
        up = await h.post(f"http://{primary}{CHAT}", content=new, headers={"content-type": "application/json"})
    assert json.loads(new)["return_token_ids"] is True
    await call.write(response_headers(200, {"content-type": "application/json",
                                            "content-length": str(len(up.content))}))
    await call.read()
    await call.write(response_body(up.content, True))
    rb = await call.read()
    out = rb.response_body.response
    assert int(set_headers(out.header_mutation)["content-length"][0]) == len(out.body_mutation.body)
    answer = json.loads(out.body_mutation.body)
    assert "prompt_token_ids" not in answer and answer["choices"][0]["message"]["role"] == "assistant"
    conv = await c.gateway.store.peek("buf")  # type: ignore[arg-type]
    assert conv is not None and conv.turn_count == 1 and conv.chain is not None
    await ch.close()


async def test_a_large_body_goes_back_in_chunks_under_64k(make_cluster: Any) -> None:
    # ~60k tokens: over the simulated workers' 4,096-token context, so the operator raises the limit (the
    # picker would otherwise answer 400 context_length_exceeded without a body mutation).
    _, ch, stub = await setup(make_cluster, hostile={"max_prompt_tokens": 200_000})
    call = stub.Process()
    raw = chat_body("log line " * 30000)
    await call.write(request_headers(CHAT, {"content-type": "application/json"}))
    for i in range(0, len(raw), 16384):
        await call.write(request_body(raw[i:i + 16384], i + 16384 >= len(raw)))
    first = await call.read()
    new = await read_body(call)
    assert len(new) > 2 * proto.CHUNK
    assert int(set_headers(first.request_headers.response.header_mutation)["content-length"][0]) == len(new)
    assert json.loads(new)["messages"][1]["content"] == "log line " * 30000
    call.cancel()
    await ch.close()


async def picked_or_immediate(stub: Any, subset: list[str] | None, path: str = CHAT,
                              body: bytes | None = None) -> ep.ProcessingResponse:
    call = stub.Process()
    raw = chat_body() if body is None else body
    await call.write(request_headers(path, {"content-type": "application/json"}, subset=subset,
                                     end_of_stream=not raw))
    if raw:
        await call.write(request_body(raw, True))
    r: ep.ProcessingResponse = await call.read()
    call.cancel()
    return r


async def test_the_endpoint_subset_is_honoured(make_cluster: Any) -> None:
    c, ch, stub = await setup(make_cluster)
    a, b = sorted(w.id for w in c.gateway.pool.all())
    for only in (a, b):
        r = await picked_or_immediate(stub, [only])
        assert destination(r) == only  # no fallback outside the subset
    for subset in ([], ["10.9.9.9:8000"]):  # empty, or nothing eligible: 503
        r = await picked_or_immediate(stub, subset)
        assert r.immediate_response.status.code == 503
        err = json.loads(r.immediate_response.body)["error"]
        assert err["code"] == "no_healthy_worker"
        hs = set_headers(r.immediate_response.headers)
        assert hs["content-type"][0] == "application/json" and "retry-after" in hs
    await eventually(lambda: all(w.in_flight == 0 for w in c.gateway.pool.all()))
    await ch.close()


@pytest.mark.parametrize(("body", "status", "code"), [
    (b"{nope", 400, "invalid_json"),
    (json.dumps({"model": "other", "messages": [{"role": "user", "content": "x"}]}).encode(), 404, "model_not_found"),
    (json.dumps({"model": MODEL}).encode(), 422, "missing_required_field"),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x" * 40000}]}).encode(), 413,
     "request_too_large"),
])
async def test_bad_requests_get_an_openai_error_as_immediate_response(make_cluster: Any, body: bytes, status: int,
                                                                     code: str | None) -> None:
    _, ch, stub = await setup(make_cluster, max_body_bytes=32768)
    r = await picked_or_immediate(stub, None, body=body)
    assert r.immediate_response.status.code == status
    err = json.loads(r.immediate_response.body)["error"]
    assert err["message"] and (code is None or err["code"] == code)
    await ch.close()


async def test_a_declared_length_over_the_limit_is_refused_at_the_headers(make_cluster: Any) -> None:
    _, ch, stub = await setup(make_cluster, max_body_bytes=4096)
    call = stub.Process()
    await call.write(request_headers(CHAT, {"content-length": "999999"}))
    r = await call.read()
    assert r.immediate_response.status.code == 413
    await ch.close()


async def test_a_request_without_body_gets_a_fallback_pick(make_cluster: Any) -> None:
    c, ch, stub = await setup(make_cluster)
    r = await picked_or_immediate(stub, None, path="/v1/models", body=b"")
    assert r.WhichOneof("response") == "request_headers"
    assert destination(r) in {w.id for w in c.gateway.pool.all()}
    assert "content-length" not in set_headers(r.request_headers.response.header_mutation)
    await ch.close()


async def test_an_aborted_stream_gives_the_slot_back_and_records_nothing(make_cluster: Any) -> None:
    c, ch, stub = await setup(make_cluster)
    before = await metric(c, "kvgate_client_disconnects_total")
    call = stub.Process()
    await call.write(request_headers(CHAT, {"x-conversation-id": "gone"}))
    await call.write(request_body(chat_body(), True))
    first = await call.read()
    w = destination(first).split(",")[0]
    await read_body(call)
    await call.write(response_headers(200, {"content-type": "text/event-stream"}))
    await call.read()
    assert c.gateway.pool.get(w).in_flight == 1
    call.cancel()  # the client went away: Envoy resets the ext_proc stream
    await eventually(lambda: c.gateway.pool.get(w).in_flight == 0)
    assert await c.gateway.store.peek("gone") is None  # type: ignore[arg-type]
    assert await metric(c, "kvgate_client_disconnects_total") == before + 1
    assert await metric(c, "kvgate_epp_streams_total", outcome="aborted") >= 1
    await ch.close()


async def test_a_fallback_endpoint_that_served_gets_the_turn(make_cluster: Any) -> None:
    c, ch, stub = await setup(make_cluster)
    call = stub.Process()
    await call.write(request_headers(CHAT, {"x-conversation-id": "fell-back"}))
    await call.write(request_body(chat_body(), True))
    first = await call.read()
    primary, fallback = destination(first).split(",")
    new = await read_body(call)
    async with httpx.AsyncClient() as h:  # the primary "failed to connect": Envoy retried the fallback
        up = await h.post(f"http://{fallback}{CHAT}", content=new, headers={"content-type": "application/json"})
    await call.write(response_headers(200, {"content-type": "application/json"}, served=fallback))
    rh = await call.read()
    assert set_headers(rh.response_headers.response.header_mutation)["x-kvgate-worker"][0] == fallback
    await call.write(response_body(up.content, True))
    while not (await call.read()).response_body.response.body_mutation.streamed_response.end_of_stream:
        pass
    conv = await c.gateway.store.peek("fell-back")  # type: ignore[arg-type]
    assert conv is not None and conv.home == fallback and conv.turns[0].reason == "fallback"
    assert c.gateway.pool.get(primary).in_flight == 0 and c.gateway.pool.get(fallback).in_flight == 0
    await ch.close()


async def test_response_trailers_end_a_response_and_are_answered(make_cluster: Any) -> None:
    c, ch, stub = await setup(make_cluster)
    call = stub.Process()
    await call.write(request_headers(CHAT, {"x-conversation-id": "trailers"}))
    await call.write(request_body(chat_body(stream=True, stream_options={"include_usage": True}), True))
    first = await call.read()
    w = destination(first).split(",")[0]
    new = await read_body(call)
    async with httpx.AsyncClient() as h:
        up = await h.post(f"http://{w}{CHAT}", content=new, headers={"content-type": "application/json"})
    await call.write(response_headers(200, {"content-type": "text/event-stream"}))
    await call.read()
    await call.write(response_body(up.content, False))  # no end_of_stream: the trailers end it
    got = b""
    await call.write(ep.ProcessingRequest(response_trailers=ep.HttpTrailers()))
    while True:
        r = await call.read()
        if r.WhichOneof("response") == "response_trailers":
            break
        got += r.response_body.response.body_mutation.streamed_response.body
    assert b'"usage"' in got  # the client asked for usage this time: it stays
    conv = await c.gateway.store.peek("trailers")  # type: ignore[arg-type]
    assert conv is not None and conv.turn_count == 1 and conv.turns[0].cached_tokens >= 0
    await ch.close()


async def test_an_upstream_error_status_is_passed_on_and_not_recorded(make_cluster: Any) -> None:
    c, ch, stub = await setup(make_cluster)
    call = stub.Process()
    await call.write(request_headers(CHAT, {"x-conversation-id": "err"}))
    await call.write(request_body(chat_body(), True))
    w = destination(await call.read()).split(",")[0]
    await read_body(call)
    await call.write(response_headers(503, {"content-type": "text/plain"}))
    await call.read()
    await call.write(response_body(b"overloaded", True))
    r = await call.read()
    assert r.response_body.response.body_mutation.streamed_response.body == b"overloaded"
    assert await c.gateway.store.peek("err") is None  # type: ignore[arg-type]
    # The status is the stream's claim: counted as one, the worker's health untouched (issue 24).
    state = c.gateway.pool.get(w)
    assert state.in_flight == 0 and state.healthy and state.health.failures == 0 and state.last_error == ""
    assert await metric(c, "kvgate_epp_reported_status_total", worker=w, status="5xx") == 1
    assert await metric(c, "kvgate_upstream_failures_total") == 0
    await ch.close()


async def test_an_unsupported_body_mode_ends_the_stream_with_a_status(make_cluster: Any) -> None:
    _, ch, stub = await setup(make_cluster)
    call = stub.Process()
    await call.write(request_headers(CHAT, {}, config=ep.ProtocolConfiguration(
        request_body_mode=pm.ProcessingMode.STREAMED)))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call.read()
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    await ch.close()


async def test_observability_mode_is_closed_cleanly(make_cluster: Any) -> None:
    _, ch, stub = await setup(make_cluster)
    call = stub.Process()
    req = request_headers(CHAT, {})
    req.observability_mode = True
    await call.write(req)
    assert await call.read() == grpc.aio.EOF
    assert await call.code() == grpc.StatusCode.OK
    await ch.close()


async def test_health_services_of_the_protocol(make_cluster: Any) -> None:
    c, ch, _ = await setup(make_cluster)
    hs = health_pb2_grpc.HealthStub(ch)
    for name in ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
        assert (await hs.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)).status == \
            health_pb2.HealthCheckResponse.SERVING
    c.gateway.draining = True  # SIGTERM: not ready any more, still alive

    async def not_ready() -> bool:
        r = await hs.Check(health_pb2.HealthCheckRequest(service="readiness"), timeout=5)
        return bool(r.status == health_pb2.HealthCheckResponse.NOT_SERVING)

    await eventually(not_ready, timeout_s=5)
    assert (await hs.Check(health_pb2.HealthCheckRequest(service="liveness"), timeout=5)).status == \
        health_pb2.HealthCheckResponse.SERVING
    await ch.close()


def test_headers_are_read_from_raw_value_or_value_and_folded() -> None:
    from kvgate.grpc.gen.envoy.config.core.v3 import base_pb2 as core

    hm = core.HeaderMap(headers=[core.HeaderValue(key="X-A", raw_value=b"1"), core.HeaderValue(key="x-a", value="2"),
                                 core.HeaderValue(key="x-b", value="v")])
    assert proto.headers_of(hm) == {"x-a": "1, 2", "x-b": "v"}
    hs: dict[str, str] = {"x-a": "old"}
    apply(hs, ep.HeaderMutation(set_headers=proto.set_headers({"x-a": "new"})))
    assert hs == {"x-a": "new"}
