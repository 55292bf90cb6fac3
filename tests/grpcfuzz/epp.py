"""The endpoint picker's streams in tests/test_grpc_fuzz.py: one script run as an ext_proc stream
(``run_stream``) and everything it answered checked (``epp``, ``check_stream``)."""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

import grpc

from kvgate.epp import protocol as proto
from kvgate.gateway.auth import tenant_salt
from kvgate.grpc.gen.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from tests.conftest import MODEL
from tests.grpcfuzz.control import resolve_text
from tests.grpcfuzz.fleet import CALL_TIMEOUT_S, GRPC_LIMIT, TENANT, Fleet, Side, Tally, settled
from tests.grpcfuzz.scripts import Bent, Body, Hdrs, Script, render
from tests.grpcfuzz.wire import parses

# --- the endpoint picker: running and checking ----------------------------------------------------------

PROCESS = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"
PACE_S = float(os.environ.get("KVGATE_GRPC_FUZZ_PACE", "0.002"))
"""A pause after each ext_proc message: time for an immediate response to reach the reader, so the script
stops writing into a stream the server has ended (its status would then be the client's own INTERNAL)."""


@dataclass
class StreamResult:
    code: grpc.StatusCode
    details: str
    responses: list[bytes]
    cancelled: bool
    overtaken: bool = False
    """The server ended the stream while the script was still writing: the client's own write failed
    and its call reports that (INTERNAL from the client's core), not the server's status. The server's side
    is then checked by the log (an unhandled error there is logged) and the slot accounting."""


def render_all(script: Script, side: Side) -> list[bytes]:
    return [render(step, side) for step in script.steps]


async def run_stream(side: Side, script: Script, frames: list[bytes]) -> StreamResult:
    mc: Any = side.epp.stream_stream(PROCESS)
    call = mc(timeout=CALL_TIMEOUT_S)
    got: list[bytes] = []
    first, ended = asyncio.Event(), asyncio.Event()

    async def read() -> None:
        async for r in call:
            got.append(r)
            first.set()
            if (m := parses(r, ep.ProcessingResponse)) is not None and m.HasField("immediate_response"):
                ended.set()  # the server ends the stream after it

    reader = asyncio.ensure_future(read())
    cancel_at = int(script.end.split(":")[1]) if script.end.startswith("cancel:") else None
    cancelled = overtaken = False
    try:
        for i, frame in enumerate(frames):
            if cancel_at == i:
                break
            if reader.done() or ended.is_set():  # the server ended the stream: the rest would not be read
                break
            await call.write(frame)
            await asyncio.sleep(PACE_S)  # the server and the reader run on this loop too: let them see it
        if cancel_at is not None:
            cancelled = call.cancel()
        elif script.end == "hold":
            with_timeout = asyncio.wait_for(first.wait(), 0.2)
            try:
                await with_timeout
            except TimeoutError:
                pass
            cancelled = call.cancel()
        else:
            await call.done_writing()
    except asyncio.InvalidStateError:
        pass  # the server ended the stream while the script was still writing: its status says why
    except grpc.aio.AioRpcError as exc:
        debug = exc.debug_error_string() or ""
        overtaken = exc.code() == grpc.StatusCode.INTERNAL and "SendMessageOperation" in debug
    try:
        await reader
    except grpc.aio.AioRpcError:
        pass
    except asyncio.CancelledError:
        cancelled = True
    code = await call.code()
    overtaken = overtaken and code == grpc.StatusCode.INTERNAL
    return StreamResult(code, await call.details() or "", got, cancelled, overtaken)


def destination_of(r: ep.ProcessingResponse) -> tuple[str | None, str | None]:
    """The pick in the header mutation and in the dynamic metadata of one response."""
    common = None
    which = r.WhichOneof("response")
    if which == "request_headers":
        common = r.request_headers.response
    elif which == "request_body":
        common = r.request_body.response
    header = None
    if common is not None:
        for o in common.header_mutation.set_headers:
            if o.header.key == proto.DESTINATION:
                header = (o.header.raw_value or o.header.value.encode()).decode()
    md = None
    if proto.DESTINATION_NS in r.dynamic_metadata.fields:
        ns = r.dynamic_metadata.fields[proto.DESTINATION_NS].struct_value
        if proto.DESTINATION in ns.fields:
            md = ns.fields[proto.DESTINATION].string_value
    return header, md


def step_flags(script: Script) -> tuple[bool, bool, bool, bool]:
    """(a subset hint of the protocol's shape, a mode the picker refuses, a malformed message, one
    over the size limit) in the script."""
    subset = unsupported = malformed = oversize = False
    for s in script.steps:
        inner = s.step if isinstance(s, Bent) else s
        if isinstance(inner, Hdrs):
            subset |= isinstance(inner.subset, list) and not inner.response
            if inner.config is not None:
                unsupported |= any(m not in (0, 2, 4) for m in inner.config)
            oversize |= sum(len(k) + len(v) + 8 for k, v, _ in inner.items) > GRPC_LIMIT - 4096
            if isinstance(inner.subset, tuple) and inner.subset[1] == ("deep", 150):
                malformed = True  # past protobuf's recursion limit: the message does not parse
            if isinstance(inner.subset, list) and len(inner.subset) * 10 > GRPC_LIMIT:
                oversize = True
        if isinstance(inner, Body):
            oversize |= len(inner.data) > GRPC_LIMIT - 4096
        if isinstance(s, Bent):
            malformed = True
    return subset, unsupported, malformed, oversize


async def epp(fleet: Fleet, side: Side, script: Script, frames: list[bytes] | None = None, replay: bool = False
              ) -> None:
    tally = fleet.tally
    if not replay:
        tally.requests["epp"] += 1
        tally.messages += len(script.steps)
        if len(fleet.replay_epp) < 150 and script.end == "close":
            fleet.replay_epp.append((side, script))
    # A worker an earlier script's 502/503/504 answer ejected is back within a health check or two; a
    # well-formed request can only be expected to get a pick when one is healthy.
    def healthy() -> bool:
        return all(w.healthy for w in side.gw.pool.all())

    # Replayed ones run alongside replayed 503 answers that eject workers meanwhile: their answers are
    # checked, a pick is not required.
    pickable = not script.well_formed or (not replay and (healthy() or await settled(healthy, 5.0)))
    t0 = time.monotonic()
    if frames is None:  # rendering thousands of headers is the client's work: not on the gateways' loop
        frames = await asyncio.to_thread(render_all, script, side)
    res = await run_stream(side, script, frames)
    tally.seconds.append((time.monotonic() - t0, f"{side.name} epp {len(script.steps)} steps {res.code.name}"))
    tally.codes[f"epp {res.code.name}"] += 1
    what = f"{side.name} {'(replayed) ' if replay else ''}{script.describe()}"
    check_stream(fleet, side, script, res, what, pickable)
    if replay:
        return
    # Every slot a stream took is given back when it ends (at once; a reset one may take a moment to reach
    # the server).
    if not await settled(side.idle, 3.0 if res.cancelled or script.end != "close" else 0.5):
        tally.find(f"a worker slot outlived its stream: {side.slots()}, admission slots {side.admitted()}", what)
        tally.stop = True


@dataclass
class Pick:
    """What a stream's answers sent on: the pick (None: none), and the request as it goes to the worker."""

    header: str | None = None
    body: bytes = b""
    length: str | None = None
    """The ``content-length`` set with the pick."""
    removed: list[str] = field(default_factory=list)
    """The headers removed with the pick."""


def check_stream(fleet: Fleet, side: Side, script: Script, res: StreamResult, what: str, pickable: bool) -> None:
    subset, unsupported, malformed, oversize = step_flags(script)
    check_status(fleet.tally, script, res, what, unsupported, malformed, oversize)
    endpoints = set(side.endpoints)
    pick = read_answers(fleet, res, endpoints, subset, what)
    if not script.well_formed or res.code != grpc.StatusCode.OK:
        return
    check_pick(fleet, side, script, res, pick, endpoints, what, pickable)


def check_status(tally: Tally, script: Script, res: StreamResult, what: str, unsupported: bool, malformed: bool,
                 oversize: bool) -> None:
    """How the stream ended: only as the script allows."""
    allowed = {grpc.StatusCode.OK}
    if unsupported:
        allowed.add(grpc.StatusCode.FAILED_PRECONDITION)
    if malformed:
        allowed.add(grpc.StatusCode.INVALID_ARGUMENT)
    if oversize:
        allowed.add(grpc.StatusCode.RESOURCE_EXHAUSTED)
    if res.cancelled:
        allowed.add(grpc.StatusCode.CANCELLED)
    if not script.well_formed:  # phases out of order, twice, after the decision: refused as the client's error
        allowed.add(grpc.StatusCode.INVALID_ARGUMENT)
    if res.overtaken:
        tally.codes["epp overtaken while writing"] += 1
    elif res.code not in allowed:
        tally.find(f"ext_proc stream ended {res.code.name}: {res.details[:300]}", what)
    elif res.code != grpc.StatusCode.OK and not res.cancelled and not res.details:
        tally.find(f"ext_proc stream ended {res.code.name} without details", what)


def read_answers(fleet: Fleet, res: StreamResult, endpoints: set[str], subset: bool, what: str) -> Pick:
    """Every answer parses, none follows an immediate response (which is checked), a pick names the pool's
    endpoints, the same in the header and the metadata, once; and what the answers sent on."""
    tally = fleet.tally
    pick = Pick()
    ended = False
    for raw in res.responses:
        r = parses(raw, ep.ProcessingResponse)
        if not isinstance(r, ep.ProcessingResponse):
            tally.find("an ext_proc answer that does not parse", what)
            continue
        if ended:
            tally.find(f"an answer after an immediate response: {r}"[:300], what)
        if r.HasField("immediate_response"):
            ended = True
            check_immediate(fleet, r.immediate_response, subset, what)
            continue
        header, md = destination_of(r)
        if header is not None or md is not None:
            if header != md:
                tally.find(f"the pick's header ({header}) and metadata ({md}) differ", what)
            names = (header or md or "").split(",")
            if not set(names) <= endpoints or not names[0]:
                tally.find(f"a pick of endpoints that are not the pool's: {header!r}", what)
            if pick.header is not None:
                tally.find("two picks in one stream", what)
            pick.header = header
            common = r.request_headers.response if r.HasField("request_headers") else r.request_body.response
            for o in common.header_mutation.set_headers:
                if o.header.key == "content-length":
                    pick.length = o.header.raw_value.decode()
            pick.removed = list(common.header_mutation.remove_headers)
            if r.HasField("request_body"):
                pick.body = common.body_mutation.body
        elif pick.header is not None and r.HasField("request_body"):
            pick.body += r.request_body.response.body_mutation.streamed_response.body
    return pick


def check_pick(fleet: Fleet, side: Side, script: Script, res: StreamResult, pick: Pick, endpoints: set[str],
               what: str, pickable: bool) -> None:
    """A well-formed request that ended OK: picked within the subset Envoy allowed, its credential removed,
    its body sent on as the request."""
    tally = fleet.tally
    if pick.header is None and not pickable:
        tally.codes["epp well-formed while a worker was ejected"] += 1
        return
    if pick.header is None:
        tally.find(f"a well-formed request got no pick ({len(res.responses)} answers: "
                   f"{[parses(x, ep.ProcessingResponse) for x in res.responses][:2]!r:.400})", what)
        return
    primary = pick.header.split(",")[0]
    allowed_subset = script.subset()
    if allowed_subset is not None:
        ok = {resolve_text(s, side).strip() for s in allowed_subset}
        if not set(pick.header.split(",")) <= ok:
            tally.find(f"a pick outside the subset Envoy allowed: {pick.header} not in {sorted(ok)}", what)
    if pick.length is not None:
        check_body_sent(tally, side, pick.length, pick.body, what)
    if side.secured and "authorization" not in pick.removed:
        tally.find("the client's credential was passed on to the worker", what)
    if primary not in endpoints:
        tally.find(f"picked {primary}, not an endpoint of the pool", what)


def check_body_sent(tally: Tally, side: Side, length: str, new_body: bytes, what: str) -> None:
    """The body sent on is the request, with its length (with auth on: the credential's tenant's salt)."""
    if int(length) != len(new_body):
        tally.find(f"content-length {length} but a body of {len(new_body)} bytes", what)
    try:
        doc = json.loads(new_body)
    except ValueError:
        doc = None
        tally.find(f"the body sent on is not JSON: {new_body[:200]!r}", what)
    if doc is not None and (not isinstance(doc, dict) or doc.get("model") != MODEL):
        tally.find(f"the body sent on is not the request: {new_body[:200]!r}", what)
    elif isinstance(doc, dict) and side.secured and doc.get("cache_salt") != tenant_salt(
            side.gw.settings.auth, TENANT):
        # The tenant is the credential's, whatever x-tenant-id says.
        tally.find(f"the body sent on carries another salt than its tenant's: {doc.get('cache_salt')}", what)


def check_immediate(fleet: Fleet, ir: ep.ImmediateResponse, subset: bool, what: str) -> None:
    tally = fleet.tally
    status = ir.status.code
    try:
        err = json.loads(ir.body)["error"]
    except (ValueError, KeyError, TypeError):
        err = None
    if not (isinstance(err, dict) and isinstance(err.get("message"), str) and isinstance(err.get("type"), str)):
        tally.find(f"immediate response {status} without an OpenAI error body: {ir.body[:200]!r}", what)
        return
    tally.codes[f"epp immediate {status} {err.get('code')}"] += 1
    if status >= 500 and not (status == 503 and subset and err.get("code") == "no_healthy_worker"):
        tally.find(f"immediate response {status}: {err}", what)
    elif status < 400:
        tally.find(f"immediate response {status}: {err}", what)
