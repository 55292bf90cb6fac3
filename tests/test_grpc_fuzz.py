"""Hostile input cannot hurt others, over gRPC (docs/hostile-input.md): a structure-aware fuzz of the gRPC
control API (``kvgate.v1`` Routing, Conversations, Policy, Fleet, and the health service beside them) and
of the Envoy endpoint picker (``envoy.service.ext_proc.v3.ExternalProcessor/Process``), the two surfaces
``tests/test_fuzz.py`` does not reach.

Requests are generated (hypothesis, derandomized, no example database: CI replays the same ones) from
valid messages by drawing every field of every request message from hostile values (empty, huge,
unicode-edge strings; NaN, ±Inf, 1e308 and subnormal doubles; int64 and int32 extremes; enum values no
proto names; repeated and map fields of thousands of entries) and then, on the wire, breaking some of
them: invalid UTF-8 in a string field (protobuf strings cannot hold lone surrogates, but the bytes can
be anything), truncation, trailing garbage, a flipped byte, 11-byte varints, unknown fields, groups
nested past the parser's recursion limit, one method's message sent to another. Everything is sent as
raw bytes through ``channel.unary_unary`` / ``stream_stream`` without serializers, so what the server
parses is exactly what was drawn. Metadata carries no, wrong, forged (a JWT signed by another key,
``alg: none``), role-less, tenant-role, binary, duplicated and oversized credentials, and tenant ids of
other tenants. Endpoint-picker streams are scripts of ext_proc messages: hostile request headers (many,
huge, odd bytes, folded duplicates, no ``:path``, unicode digits in ``content-length``, forged
``x-gateway-*`` headers), subset-hint metadata of every shape, hostile JSON bodies (test_fuzz's
mutations and encodings: deep, huge numbers, invalid UTF-8, truncated) split anywhere with
``end_of_stream`` early, late, twice or never, bodies before headers, response phases with hostile
statuses and bodies, unsupported body modes, and abrupt ends (cancelled after any message, or held
open then reset).

Two gateways, each with both gRPC servers and admission on, in front of two simulated workers: one with
auth off (conversations in memory, the cost model, full-duplex endpoint picking), one with API keys and
JWTs (conversations in the local Redis, round robin, buffered endpoint picking). The first endpoint-picker
streams and control calls are sent again 16 at a time at the end.

Asserted: no status INTERNAL, UNKNOWN or DATA_LOSS (gRPC's "5xx"), nor DEADLINE_EXCEEDED (a hang: every
call has a deadline far above its cost); every other error status carries details; UNAVAILABLE only as
``no_healthy_worker``; every answer parses as its response type; a caller without an operator's
credentials never passes the auth hook, an operator's always does; a refused ``UpdatePolicy`` changes
nothing (``GetPolicy`` before == after, the same parameter object, the change log as it was) and an
accepted one set exactly what it asked, within the documented bounds; a decision watcher sees only what
its filter asks for. The endpoint picker never ends a stream with an unhandled error (only OK, or
FAILED_PRECONDITION for a body mode it cannot serve, INVALID_ARGUMENT for a malformed message or a
request phase after the end of the request, RESOURCE_EXHAUSTED for one over the size limit, CANCELLED
for one the test reset); every immediate
response is a 4xx (or the protocol's 503 for a subset with no eligible endpoint) with an OpenAI error
body; every pick names real endpoints, the same in the header and the metadata (a forged
``x-gateway-destination-endpoint`` is overwritten, never echoed); every well-formed request gets a pick
with a parsable body and its ``content-length`` (with auth on: the credential's tenant's salt whatever
``x-tenant-id`` says, the client's ``authorization`` removed); and every worker slot and admission slot a
stream took is given back when the stream ends, however it ends. Afterwards both servers of both
gateways are healthy and serve a normal request, decision watchers are gone, and no error or traceback
was logged.

In-process, not as processes like test_fuzz.py: the gateways run on the test's event loop
(``make_cluster``) and hypothesis runs in a worker thread that hands each request to the loop. That is
reliable here (the control API's own tests run the same way), and it lets the test read what a process
would hide: the pool's slot counts after every stream (a leaked slot is exact, where RSS would only show
it after thousands), the decision bus's watchers, the policy object itself, and every log record of grpc's
and kvgate's loggers through ``caplog`` (grpc logs an unhandled servicer error there before answering
UNKNOWN). Memory is bounded by those counts and the stores' own limits rather than by RSS, which in this
process also holds hypothesis's data; the RSS growth is printed.

The gateways, the wire, the strategies and the checks are in ``tests/grpcfuzz/``; the run is here.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import redis
from grpc_health.v1 import health_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvgate.epp import protocol as proto
from kvgate.grpc.gen.envoy.config.core.v3 import base_pb2 as core
from kvgate.grpc.gen.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from kvgate.grpc.gen.kvgate.v1 import policy_pb2 as ppb
from kvgate.grpc.gen.kvgate.v1 import routing_pb2 as rpb
from tests.conftest import MODEL
from tests.grpcfuzz.control import (
    BAD_CODES,
    IDS,
    PTEXT,
    REQUESTS,
    UPDATE,
    close_watch,
    control,
    explain_request,
    get_policy,
    message_for,
    open_watch,
    update_policy_request,
)
from tests.grpcfuzz.epp import PROCESS, destination_of, epp, render_all
from tests.grpcfuzz.fleet import REDIS_URL, TENANT, TENANT_KEY, Fleet, Side, seed, settled, start
from tests.grpcfuzz.scripts import Hdrs, Script, hostile_script, render, well_formed
from tests.grpcfuzz.wire import CREDS, Cred, metadata, on_the_wire, unary

# --- the run --------------------------------------------------------------------------------------------

FUZZ = settings(derandomize=True, database=None, deadline=None, print_blob=False,
                suppress_health_check=list(HealthCheck))
SCALE = float(os.environ.get("KVGATE_FUZZ_SCALE", "1"))
"""A longer (or shorter) local run, as in test_fuzz.py."""
N = {k: max(1, round(v * SCALE)) for k, v in {
    "explain": 200, "conversations": 80, "update_policy": 130, "reads": 80, "watch": 30, "raw_control": 100,
    "epp_well_formed": 200, "epp_hostile": 400}.items()}


def fuzz_all(fleet: Fleet) -> None:
    """Runs in a worker thread: hypothesis draws, the gateways' loop sends (``Fleet.run``)."""

    def send(secured: bool, method: str, data: bytes, cred: Cred) -> None:
        side = fleet.side(secured)
        fleet.run(control(fleet, side, method, data, metadata(fleet, cred), cred.expect))

    @given(req=explain_request(), secured=st.booleans(), cred=CREDS, data=st.data())
    def explain(req: bytes, secured: bool, cred: Cred, data: st.DataObject) -> None:
        wire = data.draw(on_the_wire(req, rpb.ExplainRequest))
        send(secured, "/kvgate.v1.Routing/Explain", wire, cred)

    @given(method=st.sampled_from(["/kvgate.v1.Conversations/GetConversation",
                                   "/kvgate.v1.Conversations/GetNextPrefix"]),
           secured=st.booleans(), cred=CREDS, data=st.data())
    def conversations(method: str, secured: bool, cred: Cred, data: st.DataObject) -> None:
        msg = data.draw(message_for(method))
        wire = data.draw(on_the_wire(msg, REQUESTS[method][0]))
        send(secured, method, wire, cred)

    @given(req=update_policy_request(), secured=st.booleans(), cred=CREDS, data=st.data())
    def update_policy(req: bytes, secured: bool, cred: Cred, data: st.DataObject) -> None:
        wire = data.draw(on_the_wire(req, ppb.UpdatePolicyRequest))
        send(secured, UPDATE, wire, cred)

    @given(method=st.sampled_from(["/kvgate.v1.Policy/GetPolicy", "/kvgate.v1.Policy/ListPolicyChanges",
                                   "/kvgate.v1.Fleet/ListWorkers", "/grpc.health.v1.Health/Check"]),
           secured=st.booleans(), cred=CREDS, data=st.data())
    def reads(method: str, secured: bool, cred: Cred, data: st.DataObject) -> None:
        msg = data.draw(message_for(method))
        wire = data.draw(on_the_wire(msg, REQUESTS[method][0]))
        send(secured, method, wire, cred)

    @given(model=st.sampled_from(["", MODEL, "other"]) | PTEXT, conv=st.sampled_from(["", "wf-0"]) | IDS,
           tenant=st.sampled_from(["", TENANT, "other"]) | PTEXT, scores=st.booleans(), secured=st.booleans(),
           cred=CREDS, deadline=st.none() | st.sampled_from([0.001, 0.05]), data=st.data())
    def watch(model: str, conv: str, tenant: str, scores: bool, secured: bool, cred: Cred, deadline: float | None,
              data: st.DataObject) -> None:
        msg = rpb.WatchDecisionsRequest(model=model, conversation_id=conv, tenant=tenant,
                                        include_scores=scores).SerializeToString()
        wire = data.draw(on_the_wire(msg, rpb.WatchDecisionsRequest))
        side = fleet.side(secured)
        fleet.run(open_watch(fleet, side, wire, metadata(fleet, cred), cred.expect, deadline))

    @given(method=st.sampled_from([*REQUESTS, "/kvgate.v1.Policy/Nope", "/kvgate.v1.Nope/GetPolicy",
                                   "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
                                   "/kvgate.v1.Routing/Explain"]),
           other=st.sampled_from(list(REQUESTS)), secured=st.booleans(), cred=CREDS, data=st.data())
    def raw_control(method: str, other: str, secured: bool, cred: Cred, data: st.DataObject) -> None:
        # Another method's message (its fields read as this one's), or bytes bent on the wire.
        msg = data.draw(message_for(other))
        wire = data.draw(on_the_wire(msg, REQUESTS[other][0]))
        send(secured, method, wire, cred)

    @given(script=well_formed(), secured=st.booleans())
    def epp_well_formed(script: Script, secured: bool) -> None:
        side = fleet.side(secured)
        fleet.run(epp(fleet, side, script, render_all(script, side)))

    @given(script=hostile_script(), secured=st.booleans())
    def epp_hostile(script: Script, secured: bool) -> None:
        side = fleet.side(secured)
        fleet.run(epp(fleet, side, script, render_all(script, side)))

    # Well-formed streams first: the turns they record give the conversation reads something to find.
    for fn, n in ((epp_well_formed, N["epp_well_formed"]), (explain, N["explain"]),
                  (conversations, N["conversations"]), (update_policy, N["update_policy"]), (reads, N["reads"]),
                  (watch, N["watch"]), (raw_control, N["raw_control"]), (epp_hostile, N["epp_hostile"])):
        settings(FUZZ, max_examples=n)(fn)()


async def replay_concurrently(fleet: Fleet) -> None:
    """The fuzz sends one request at a time; the first endpoint-picker streams and control calls go again,
    16 at a time, so hostile streams interleave with each other and with the control API."""
    sem = asyncio.Semaphore(16)

    async def one(aw: Coroutine[Any, Any, Any]) -> None:
        async with sem:
            await aw

    async def control_again(side: Side, method: str, data: bytes, md: tuple[tuple[str, str | bytes], ...]) -> None:
        out = await unary(side.control, method, data, md)
        if out.code in BAD_CODES:
            fleet.tally.find(f"(replayed) {out.code.name}: {out.details[:300]}", f"{side.name} {method} {data[:300]!r}")

    await asyncio.gather(*(one(epp(fleet, side, s, replay=True)) for side, s in fleet.replay_epp),
                         *(one(control_again(*c)) for c in fleet.replay_control))


class LoopProbe:
    """The control API's health check polled on the gateways' loop while the fuzz runs: how long hostile
    requests held the loop up (reported, not asserted: the machine is shared)."""

    def __init__(self, side: Side) -> None:
        self.side = side
        self.latencies: list[float] = []
        self.task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(0.05)
            t = time.perf_counter()
            out = await unary(self.side.control, "/grpc.health.v1.Health/Check", b"", ())
            assert out.code == grpc.StatusCode.OK, out
            self.latencies.append(time.perf_counter() - t)

    async def stop(self) -> list[float]:
        self.task.cancel()
        try:
            await self.task
        except asyncio.CancelledError:
            pass
        return sorted(self.latencies) or [0.0]


def leftover(r: logging.LogRecord) -> bool:
    """An earlier test's task collected during this one (asyncio logs it when the garbage collector
    finds it): its loop is closed, so it is not this test's gateways."""
    return r.name == "asyncio" and "Event loop is closed" in r.getMessage()


def rss_mib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) // 1024
    return 0


async def healthy_afterwards(side: Side) -> None:
    for name in ("", "kvgate.v1.Routing", "kvgate.v1.Conversations", "kvgate.v1.Policy", "kvgate.v1.Fleet"):
        out = await unary(side.control, "/grpc.health.v1.Health/Check",
                          health_pb2.HealthCheckRequest(service=name).SerializeToString(), ())
        assert out.code == grpc.StatusCode.OK and out.data is not None, (side.name, name, out)
        assert health_pb2.HealthCheckResponse.FromString(out.data).status == health_pb2.HealthCheckResponse.SERVING
    for name in ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
        out = await unary(side.epp, "/grpc.health.v1.Health/Check",
                          health_pb2.HealthCheckRequest(service=name).SerializeToString(), ())
        assert out.code == grpc.StatusCode.OK and out.data is not None, (side.name, name, out)
        assert health_pb2.HealthCheckResponse.FromString(out.data).status == health_pb2.HealthCheckResponse.SERVING
    body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "are you still there?"}]}
    out = await unary(side.control, "/kvgate.v1.Routing/Explain", rpb.ExplainRequest(
        body_json=json.dumps(body), headers={"x-conversation-id": "after-fuzz"}).SerializeToString(),
        side.operator_md())
    assert out.code == grpc.StatusCode.OK and out.data is not None, (side.name, out)
    assert rpb.ExplainResponse.FromString(out.data).decision.worker in side.workers
    await get_policy(side)
    # A normal request through the endpoint picker: a pick, the worker's real answer, the turn recorded.
    raw = json.dumps(body).encode()
    mc: Any = side.epp.stream_stream(PROCESS, request_serializer=ep.ProcessingRequest.SerializeToString,
                                     response_deserializer=ep.ProcessingResponse.FromString)
    call = mc(timeout=30)
    hdrs = Hdrs(False, ((":method", b"POST", True), (":path", b"/v1/chat/completions", True),
                        ("x-conversation-id", b"after-fuzz-epp", True), ("content-type", b"application/json", True),
                        ("authorization", f"Bearer {TENANT_KEY}".encode(), True)))
    await call.write(ep.ProcessingRequest.FromString(render(hdrs, side)))
    await call.write(ep.ProcessingRequest(request_body=ep.HttpBody(body=raw, end_of_stream=True)))
    first: ep.ProcessingResponse = await call.read()
    if side.gw.settings.epp_body_mode == "buffered":
        first = await call.read()
        new = first.request_body.response.body_mutation.body
    else:
        new = b""
        while True:
            r = await call.read()
            sr = r.request_body.response.body_mutation.streamed_response
            new += sr.body
            if sr.end_of_stream:
                break
    picked = destination_of(first)[0]
    assert picked is not None and picked.split(",")[0] in side.endpoints, first
    async with httpx.AsyncClient(timeout=30) as h:
        up = await h.post(f"http://{picked.split(',')[0]}/v1/chat/completions", content=new,
                          headers={"content-type": "application/json"})
    assert up.status_code == 200, up.text
    await call.write(ep.ProcessingRequest.FromString(render(Hdrs(True, ((":status", b"200", True), (
        "content-type", b"application/json", True))), side)))
    await call.read()
    await call.write(ep.ProcessingRequest(response_body=ep.HttpBody(body=up.content, end_of_stream=True)))
    await call.read()
    await call.done_writing()
    assert await call.code() == grpc.StatusCode.OK
    cid = f"{TENANT}/after-fuzz-epp" if side.secured else "after-fuzz-epp"
    assert await side.gw.store.peek(cid) is not None, "the normal request's turn was not recorded"
    async with httpx.AsyncClient(timeout=30) as h:
        assert (await h.get(side.cluster.url + "/health")).status_code == 200


async def test_grpc_fuzz(make_cluster: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    started = time.monotonic()
    open_c, secured_c, key, forged, prefix = await start(make_cluster, tmp_path)
    sides = []
    for name, c, secured in (("open", open_c, False), ("secured", secured_c, True)):
        g = c.gateway_handle.server.config.app.state.grpc  # type: ignore[union-attr]
        sides.append(Side(name, c, grpc.aio.insecure_channel(f"127.0.0.1:{g.control_port}"),
                          grpc.aio.insecure_channel(f"127.0.0.1:{g.epp_port}"), secured))
    fleet = Fleet(sides[0], sides[1], asyncio.get_running_loop(), key, forged)
    try:
        for side in sides:
            await seed(side)
        rss_before = rss_mib()
        probe = LoopProbe(fleet.open)
        try:
            await asyncio.to_thread(fuzz_all, fleet)
            for w in list(fleet.watches):
                if not w.task.done():
                    await close_watch(fleet, w)
            fuzzed = time.monotonic()
            if not fleet.tally.stop:
                await replay_concurrently(fleet)
        finally:
            loop_lat = await probe.stop()
        for w in fleet.watches:  # the ones that ended by themselves (refused, deadline): their checks
            if w.task.done():
                await close_watch(fleet, w)
        for side in sides if not fleet.tally.stop else []:
            if not await settled(side.idle, 5.0):
                fleet.tally.find(f"slots held after the fuzz: {side.slots()}, admission {side.admitted()}", side.name)
            bus = side.servers.bus
            if not await settled(lambda: bus.watchers == 0, 5.0):  # noqa: B023 (awaited here)
                fleet.tally.find(f"{bus.watchers} decision watchers left after the fuzz", side.name)
            assert len(side.gw.policy_log.recent()) <= 256
            try:
                await healthy_afterwards(side)
            except (AssertionError, grpc.aio.AioRpcError, httpx.HTTPError) as exc:
                fleet.tally.find(f"not healthy after the fuzz: {exc!r:.500}", side.name)
        stats = fleet.open.gw.store.stats()
        assert stats["bytes"] <= 32 * 1024 * 1024  # max_store_bytes
        rss_after = rss_mib()
    finally:
        for side in sides:
            await side.control.close()
            await side.epp.close()
        r = redis.Redis.from_url(REDIS_URL)
        keys = list(r.scan_iter(match=prefix + "*"))
        if keys:
            r.delete(*keys)
        r.close()
    tally = fleet.tally
    elapsed = time.monotonic() - started
    slow = sorted(tally.seconds, reverse=True)
    print(f"GRPC FUZZ {dict(tally.requests)} hostile requests ({tally.messages} ext_proc messages) in "
          f"{fuzzed - started:.1f} s, then {len(fleet.replay_epp) + len(fleet.replay_control)} replayed "
          f"concurrently; test {elapsed:.1f} s; RSS {rss_before} -> {rss_after} MiB; open store {stats}")
    print(f"codes: {sorted(tally.codes.items(), key=lambda kv: -kv[1])}")
    print(f"loop (health check while fuzzed): {len(loop_lat)} probes, p50 {loop_lat[len(loop_lat) // 2] * 1000:.1f} "
          f"ms, p99 {loop_lat[len(loop_lat) * 99 // 100] * 1000:.1f} ms, max {loop_lat[-1] * 1000:.1f} ms")
    print(f"slowest: {[(round(t, 2), w) for t, w in slow[:5]]}; median {slow[len(slow) // 2][0] * 1000:.1f} ms")
    assert not tally.findings, f"{len(tally.findings)} distinct problems:\n" + "\n".join(tally.findings.values())
    errors = [r for r in caplog.records if (r.levelno >= logging.ERROR or r.exc_info) and not leftover(r)]
    assert not errors, "\n".join(f"{r.name}: {r.getMessage()[:500]}" for r in errors[:10])
    assert not any("Traceback" in r.getMessage() for r in caplog.records)
    assert sum(tally.requests.values()) >= 1000 * min(SCALE, 1.0)



def test_repeated_header_names_cost_linear_time() -> None:
    """Envoy folds a repeated header name into one line, and so does the picker: 250,000 repeats of one
    name fit in a 2 MiB ext_proc message. Folded one value at a time that was quadratic (1.6 s of the
    event loop for one message); ten times the repeats must cost about ten times as much, not a hundred."""

    def cost(n: int) -> float:
        hm = core.HeaderMap(headers=[core.HeaderValue(key="x-many", raw_value=b"1") for _ in range(n)])
        best = math.inf
        for _ in range(3):
            t = time.perf_counter()
            folded = proto.headers_of(hm)
            best = min(best, time.perf_counter() - t)
        assert folded == {"x-many": ", ".join(["1"] * n)}
        return best

    small, large = cost(20_000), cost(200_000)
    assert large < 30 * small, (small, large)
