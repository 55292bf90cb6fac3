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
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import logging
import math
import os
import re
import time
import uuid
from collections import Counter
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx
import jwt
import pytest
import redis
from cryptography.hazmat.primitives.asymmetric import rsa
from google.protobuf import struct_pb2
from google.protobuf.message import DecodeError, Message
from grpc_health.v1 import health_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jwt.algorithms import RSAAlgorithm

from kvgate.epp import protocol as proto
from kvgate.gateway.auth import key_hash, tenant_salt
from kvgate.gateway.policyedit import MAX_ABS, MAX_INT
from kvgate.grpc.gen.envoy.config.core.v3 import base_pb2 as core
from kvgate.grpc.gen.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from kvgate.grpc.gen.kvgate.v1 import conversations_pb2 as cpb
from kvgate.grpc.gen.kvgate.v1 import fleet_pb2 as fpb
from kvgate.grpc.gen.kvgate.v1 import policy_pb2 as ppb
from kvgate.grpc.gen.kvgate.v1 import routing_pb2 as rpb
from tests.conftest import MODEL, Cluster
from tests.test_fuzz import CHAT, COMPLETION, CONV_IDS, HUGE_TEXT, MAX_BODY, TEXT, encoded, mutated

# --- the fleet under test -------------------------------------------------------------------------------

TENANT_KEY, OPERATOR_KEY, NOROLE_KEY = "gf-tenant-key", "gf-operator-key", "gf-none-key"
TENANT = "gf"
REDIS_URL = "redis://127.0.0.1:6379/0"
GRPC_LIMIT = MAX_BODY + (1 << 20)
"""The servers' message size limit (``max_body_bytes`` + 1 MiB, kvgate/grpc/server.py)."""
CALL_TIMEOUT_S = 20.0
"""Every call's deadline: far above what any request here costs, so DEADLINE_EXCEEDED means a hang."""
PROCESS = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"
PACE_S = float(os.environ.get("KVGATE_GRPC_FUZZ_PACE", "0.002"))
"""A pause after each ext_proc message: time for an immediate response to reach the reader, so the script
stops writing into a stream the server has ended (its status would then be the client's own INTERNAL)."""
METADATA_SOFT = 8192 - 1024
"""Request metadata past gRPC's soft limit (8 KiB with the call's own headers) may be refused by the
transport, RESOURCE_EXHAUSTED, before kvgate sees it."""


@dataclass
class Side:
    name: str
    cluster: Cluster
    control: grpc.aio.Channel
    epp: grpc.aio.Channel
    secured: bool

    @property
    def gw(self) -> Any:
        return self.cluster.gateway

    @property
    def servers(self) -> Any:
        return self.cluster.gateway_handle.server.config.app.state.grpc  # type: ignore[union-attr]

    @property
    def workers(self) -> list[str]:
        return sorted(w.id for w in self.gw.pool.all())

    @property
    def endpoints(self) -> list[str]:
        from kvgate.epp.endpoints import endpoint_of

        return sorted(endpoint_of(w.config) for w in self.gw.pool.all())

    def operator_md(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {OPERATOR_KEY}"),) if self.secured else ()

    def slots(self) -> dict[str, tuple[int, int, int, int]]:
        return {w.id: (w.in_flight, w.pending_prefill, w.pending_requests, w.decode_requests)
                for w in self.gw.pool.all()}

    def idle(self) -> bool:
        return all(v == (0, 0, 0, 0) for v in self.slots().values()) and self.admitted() == 0

    def admitted(self) -> int:
        """Admission slots held (a ticket not given back holds one for good)."""
        a = self.gw.admission
        return 0 if a is None else int(a.busy(MODEL))


@dataclass
class Tally:
    requests: Counter[str] = field(default_factory=Counter)
    """Hostile requests sent, by surface (control, epp); each ext_proc stream counts once."""
    messages: int = 0
    """ext_proc messages written over all streams."""
    codes: Counter[str] = field(default_factory=Counter)
    findings: dict[str, str] = field(default_factory=dict)
    seconds: list[tuple[float, str]] = field(default_factory=list)
    stop: bool = False
    """A leak was found: the gateways' state is no longer what later checks assume (and requests may queue
    behind leaked admission slots), so nothing more is sent; the finding is reported at once."""

    def find(self, problem: str, what: str) -> None:
        key = re.sub(r"[0-9]+", "N", problem[:120])
        if key not in self.findings:
            self.findings[key] = f"{problem[:600]}\n    request: {what[:900]}"


@dataclass
class Fleet:
    open: Side
    secured: Side
    loop: asyncio.AbstractEventLoop
    jwt_key: Any
    forged_key: Any
    tally: Tally = field(default_factory=Tally)
    watches: list[WatchRun] = field(default_factory=list)
    replay_epp: list[tuple[Side, Script]] = field(default_factory=list)
    replay_control: list[tuple[Side, str, bytes, tuple[tuple[str, str | bytes], ...]]] = field(default_factory=list)

    def side(self, secured: bool) -> Side:
        return self.secured if secured else self.open

    def run(self, coro: Coroutine[Any, Any, Any]) -> None:
        """From hypothesis's thread: ``coro`` on the gateways' loop, waited for."""
        if self.tally.stop:
            coro.close()
            return
        asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=4 * CALL_TIMEOUT_S)


def jwks(key: Any) -> dict[str, Any]:
    jwk = json.loads(RSAAlgorithm.to_jwk(key.public_key()))
    return {"keys": [{**jwk, "kid": "gf", "alg": "RS256"}]}


async def start(make_cluster: Any, tmp: Path) -> tuple[Cluster, Cluster, Any, Any, str]:
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    forged = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    (tmp / "jwks.json").write_text(json.dumps(jwks(key)))
    prefix = f"kvgate-grpcfuzz:{uuid.uuid4().hex[:8]}:"
    # Admission on both, with limits no fuzz run reaches: every endpoint-picker request takes a ticket it must
    # give back when its stream ends, however it ends.
    admission = {"enabled": True, "defaults": {"max_concurrent": 256, "requests_per_minute": 1_000_000,
                                               "tokens_per_minute": 1_000_000_000}}
    common: dict[str, Any] = {"grpc_port": 0, "epp_port": 0, "max_body_bytes": MAX_BODY, "drain_timeout_s": 1,
                              "max_store_bytes": 32 * 1024 * 1024, "max_conversation_bytes": 1024 * 1024,
                              "admission": admission}
    auth = {"mode": "both", "cache_salt_secret": "gf-salt",
            "api_keys": [{"sha256": key_hash(TENANT_KEY), "tenant": TENANT, "role": "tenant", "name": "t"},
                         {"sha256": key_hash(OPERATOR_KEY), "tenant": TENANT, "role": "operator", "name": "o"},
                         {"sha256": key_hash(NOROLE_KEY), "tenant": TENANT, "role": "none", "name": "n"}],
            "jwt": {"jwks_file": str(tmp / "jwks.json"), "tenant_claim": "org.id", "role_claim": "roles"}}
    open_c = await make_cluster(2, **common)
    secured_c = await make_cluster(2, **common, auth=auth, policy="round_robin", session_store="redis",
                                   redis_url=REDIS_URL, redis_prefix=prefix, session_ttl_s=600,
                                   epp_body_mode="buffered")
    return open_c, secured_c, key, forged, prefix


# --- the wire -------------------------------------------------------------------------------------------

def varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # negative int32/int64 values take ten bytes, as protobuf writes them
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        if not n:
            out.append(b)
            return bytes(out)
        out.append(b | 0x80)


def tag(num: int, wire: int) -> bytes:
    return varint(num << 3 | wire)


def ld(num: int, data: bytes) -> bytes:
    return tag(num, 2) + varint(len(data)) + data


BAD_UTF8 = st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xed\xbf\xbf", b"\xf4\x90\x80\x80", b"\xc0\xaf",
                            b"a\x80b", b"gf-1\xfe", b"\xef\xbb\xbf\xff", b"\xe2\x82"]) \
    | st.binary(min_size=1, max_size=20).filter(lambda b: not _utf8(b))


def _utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


StringField = Callable[[bytes], bytes]
"""A string field of a message, written with the given (invalid UTF-8) bytes."""


def string_fields(msg: type[Message]) -> list[StringField]:
    """Every string field of ``msg`` (in map entries and nested request messages too), as writers."""
    def plain(n: int) -> StringField:
        return lambda b: ld(n, b)

    def map_key(n: int) -> StringField:
        return lambda b: ld(n, ld(1, b) + ld(2, b"v"))

    def map_value(n: int) -> StringField:
        return lambda b: ld(n, ld(1, b"k") + ld(2, b))

    out: list[StringField] = []
    for f in msg.DESCRIPTOR.fields:
        if f.type == f.TYPE_STRING:
            out.append(plain(f.number))
        elif f.type == f.TYPE_MESSAGE and f.message_type is not None and f.message_type.GetOptions().map_entry:
            out += [map_key(f.number), map_value(f.number)]
    return out


@st.composite
def on_the_wire(draw: st.DrawFn, data: bytes, msg: type[Message]) -> bytes:
    """``data`` (a serialized ``msg``) as sent: mostly as is, else broken or bent on the wire."""
    how = draw(st.sampled_from(["as_is"] * 10 + ["bad_utf8"] * 3 + [
        "truncate", "garbage_tail", "flip", "unknown_fields", "overlong_varint", "deep_groups", "wrong_wire_type",
        "empty", "only_garbage", "duplicate"]))
    strings = string_fields(msg)
    if how == "bad_utf8" and strings:
        return data + draw(st.sampled_from(strings))(draw(BAD_UTF8))
    if how == "truncate" and data:
        return data[:draw(st.integers(0, len(data) - 1))]
    if how == "garbage_tail":
        return data + draw(st.binary(min_size=1, max_size=64))
    if how == "flip" and data:
        i = draw(st.integers(0, len(data) - 1))
        return data[:i] + bytes([draw(st.integers(0, 255))]) + data[i + 1:]
    if how == "unknown_fields":  # valid: must be ignored
        return data + tag(1999, 0) + varint(draw(st.integers(0, 2**64 - 1))) + ld(2000, draw(st.binary(max_size=64))) \
            + tag(2001, 1) + b"\x00" * 8 + tag(2002, 5) + b"\x00" * 4
    if how == "overlong_varint":
        nums = [f.number for f in msg.DESCRIPTOR.fields] or [1]
        return data + tag(draw(st.sampled_from(nums)), 0) + b"\xff" * 10 + b"\x01"
    if how == "deep_groups":
        n = draw(st.integers(50, 400))
        return data + tag(1999, 3) * n + tag(1999, 4) * n
    if how == "wrong_wire_type":
        nums = [f.number for f in msg.DESCRIPTOR.fields] or [1]
        num = draw(st.sampled_from(nums))
        wire = draw(st.sampled_from([0, 1, 2, 5]))
        payload = {0: varint(7), 1: b"\x01" * 8, 2: varint(3) + b"abc", 5: b"\x01" * 4}[wire]
        return data + tag(num, wire) + payload
    if how == "empty":
        return b""
    if how == "only_garbage":
        return draw(st.binary(max_size=300))
    if how == "duplicate":  # singular fields: the last wins; repeated ones: twice as many
        return data + data
    return data


def parses(data: bytes, msg: type[Message]) -> Message | None:
    try:
        return msg.FromString(data)
    except (DecodeError, RecursionError):
        return None


# --- credentials ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Cred:
    """What a call shows the auth hook. ``expect``: "operator" must pass it, "refused" must not, None:
    either (claims drawn from hostile values)."""

    kind: str
    value: Any = None
    expect: str | None = "refused"


ASCII = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=60)
"""Metadata values gRPC lets a client send (printable ASCII); anything else goes in a -bin key."""
CLAIM = st.sampled_from([TENANT, "other", "operator", "tenant", ["tenant", "operator"], [], 7, None, {"id": TENANT},
                         "", "\x00", "é" * 300]) | TEXT | st.integers(-(2**63), 2**63)
OPERATOR_CREDS = (
    st.just(Cred("key", OPERATOR_KEY, "operator"))
    | st.just(Cred("x-api-key", OPERATOR_KEY, "operator"))
    | st.just(Cred("jwt", {"org": {"id": TENANT}, "roles": ["operator"]}, "operator")))
OTHER_CREDS = (
    st.just(Cred("key", TENANT_KEY)) | st.just(Cred("x-api-key", TENANT_KEY)) | st.just(Cred("key", NOROLE_KEY))
    | st.builds(lambda k: Cred("key", k), ASCII)
    | st.builds(lambda v: Cred("raw", v), ASCII | st.sampled_from(["Bearer", "Bearer ", "Basic Zm9vOmJhcg==",
                                                                   f"bearer {OPERATOR_KEY}x", "Bearer a.b.c",
                                                                   f"Bearer {OPERATOR_KEY[:-1]}"]))
    | st.builds(lambda c: Cred("jwt", c, None), st.fixed_dictionaries(
        {"org": st.fixed_dictionaries({"id": CLAIM}) | CLAIM},
        optional={"roles": CLAIM, "exp": st.integers(-(2**40), 2**40), "nbf": st.integers(-(2**40), 2**40),
                  "aud": CLAIM, "iss": CLAIM}))
    | st.just(Cred("forged", {"org": {"id": TENANT}, "roles": ["operator"]}))
    | st.just(Cred("alg_none", {"org": {"id": TENANT}, "roles": ["operator"]}))
    | st.just(Cred("hs256", {"org": {"id": TENANT}, "roles": ["operator"]}))
    | st.just(Cred("expired", {"org": {"id": TENANT}, "roles": ["operator"]}))
    | st.builds(lambda b: Cred("bin", b), st.binary(max_size=60) | st.just(f"Bearer {OPERATOR_KEY}".encode()))
    | st.builds(lambda first: Cred("dup", first, None), st.booleans())
    | st.builds(lambda n: Cred("huge", n), st.integers(4_000, 20_000))
    | st.just(Cred("tenant_header", "other")) | st.just(Cred("none"))
)
CREDS = st.booleans().flatmap(lambda op: OPERATOR_CREDS if op else OTHER_CREDS)
"""Half an operator's (the secured gateway's services are reached), half anything else (its auth hook)."""


def b64(d: bytes) -> str:
    return base64.urlsafe_b64encode(d).rstrip(b"=").decode()


def metadata(fleet: Fleet, c: Cred) -> tuple[tuple[str, str | bytes], ...]:
    def signed(claims: dict[str, Any], key: Any, exp: int | None = None) -> str:
        claims = {**claims}
        claims.setdefault("exp", exp if exp is not None else int(time.time()) + 600)
        try:
            return jwt.encode(claims, key, algorithm="RS256", headers={"kid": "gf"})
        except (TypeError, ValueError, OverflowError):  # claims PyJWT will not encode: sent unsigned
            return f"eyJhbGciOiJSUzI1NiJ9.{b64(repr(claims).encode())}.c2ln"

    if c.kind == "key":
        return (("authorization", f"Bearer {c.value}"),)
    if c.kind == "x-api-key":
        return (("x-api-key", c.value),)
    if c.kind == "raw":
        return (("authorization", c.value),)
    if c.kind == "jwt":
        return (("authorization", f"Bearer {signed(c.value, fleet.jwt_key)}"),)
    if c.kind == "forged":  # the right claims, someone else's key, the trusted key's id
        return (("authorization", f"Bearer {signed(c.value, fleet.forged_key)}"),)
    if c.kind == "expired":
        return (("authorization", f"Bearer {signed(c.value, fleet.jwt_key, exp=int(time.time()) - 3600)}"),)
    if c.kind == "alg_none":
        head = b64(json.dumps({"alg": "none", "typ": "JWT", "kid": "gf"}).encode())
        return (("authorization", f"Bearer {head}.{b64(json.dumps(c.value).encode())}."),)
    if c.kind == "hs256":  # algorithm confusion: HMAC keyed with the public key's JWK
        head = b64(json.dumps({"alg": "HS256", "typ": "JWT", "kid": "gf"}).encode())
        body = b64(json.dumps({**c.value, "exp": int(time.time()) + 600}).encode())
        secret = json.dumps(jwks(fleet.jwt_key)["keys"][0]).encode()
        sig = b64(hmac.new(secret, f"{head}.{body}".encode(), hashlib.sha256).digest())
        return (("authorization", f"Bearer {head}.{body}.{sig}"),)
    if c.kind == "bin":
        return (("authorization-bin", c.value),)
    if c.kind == "dup":
        pair = [("authorization", f"Bearer {OPERATOR_KEY}"), ("authorization", "Bearer nope")]
        return tuple(pair if c.value else pair[::-1])
    if c.kind == "huge":
        return (("authorization", "Bearer " + "k" * c.value),)
    if c.kind == "tenant_header":
        return (("x-tenant-id", c.value), ("x-kvgate-role", "operator"))
    return ()


# --- the control API: requests --------------------------------------------------------------------------

PTEXT = TEXT | HUGE_TEXT
"""Hostile text a proto string can hold (no lone surrogates: those go on the wire as invalid UTF-8)."""
KNOWN_IDS = st.sampled_from(["seed-1", "seed-2", f"{TENANT}/seed-1", f"{TENANT}/seed-2"])
"""Conversations with a completed turn (``seed``; the secured gateway scopes them by tenant)."""
IDS = st.integers(0, 2).flatmap(lambda i: KNOWN_IDS if i else st.sampled_from(
    ["other/seed-1", "seed-1/", "SEED-1", "seed-1\x00", f"{TENANT}/", "/seed-1", "nope"])
    | CONV_IDS.filter(lambda s: _utf8(s.encode("utf-8", "surrogatepass"))))
WORKERS = st.sampled_from(["$w0", "$w1", "$e0", "$e1", " $e0 ", "$e0,$e1", "", "10.9.9.9:8000", "[::1]:1",
                           "127.0.0.1:0"]) | PTEXT
HEADER_NAMES = ["x-conversation-id", "x-session-id", "x-tenant-id", "x-kvgate-reasoning-policy", "priority",
                "x-priority", "authorization", "x-api-key", "x-gateway-destination-endpoint", "X-Conversation-Id",
                "X-TENANT-ID", "traceparent", "content-type", ":path", ""]
HEADER_VALUES = st.sampled_from(["seed-1", "wf-0", TENANT, "other", "gf/seed-1", "keep", "drop", "truncate:2",
                                 "truncate:²", "truncate:" + "9" * 5000, "high", "-1", f"Bearer {OPERATOR_KEY}",
                                 "10.9.9.9:8000"]) | PTEXT


def many(strategy: st.SearchStrategy[str], most: int) -> st.SearchStrategy[list[str]]:
    """Mostly a few, now and then thousands (repeated fields; the thousands of short values: thousands of
    huge ones are only a message over the size limit, which a few huge ones already are)."""
    return st.integers(0, 9).flatmap(lambda i: st.lists(strategy, max_size=4) if i else st.builds(
        lambda x, n: [x[:64]] * n, strategy, st.integers(100, most)))


ENDPOINT_ENUM = st.sampled_from([0, 1, 2]) | st.integers(-(2**31), 2**31 - 1)
WELL_TEXT = st.sampled_from(["hi", "Where is the bug?", "é🙂", "<|im_start|>", "\u202e", "a\x00b", " "]) \
    | st.text(min_size=1, max_size=60)
WELL_MSG = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]), "content": WELL_TEXT})
WELL_CHAT = st.fixed_dictionaries(
    {"model": st.just(MODEL), "messages": st.lists(WELL_MSG, max_size=3).map(
        lambda ms: [*ms, {"role": "user", "content": "and now?"}])},
    optional={"max_tokens": st.integers(1, 8), "stream": st.booleans(), "temperature": st.floats(0, 2),
              "reasoning_policy": st.sampled_from(["keep", "drop", "truncate:4"]), "user": WELL_TEXT})
WELL_COMPLETION = st.fixed_dictionaries(
    {"model": st.just(MODEL), "prompt": WELL_TEXT | st.lists(st.integers(0, 200), min_size=1, max_size=20)},
    optional={"max_tokens": st.integers(1, 8), "stream": st.booleans()})


@st.composite
def explain_request(draw: st.DrawFn) -> bytes:
    completions = draw(st.booleans())
    kind = draw(st.integers(0, 9))
    if kind < 2:  # valid bodies: the deeper checks (history, routing) are reached
        body = json.dumps(draw(WELL_COMPLETION if completions else WELL_CHAT)).encode()
    else:
        body = draw(encoded(draw(mutated(COMPLETION if completions else CHAT))))
    req = rpb.ExplainRequest(
        endpoint=draw(st.just(int(rpb.ENDPOINT_COMPLETIONS if completions else rpb.ENDPOINT_CHAT))
                      | ENDPOINT_ENUM),  # type: ignore[arg-type]  # an open enum: any int32 goes
        headers=draw(st.dictionaries(st.sampled_from(HEADER_NAMES) | PTEXT, HEADER_VALUES, max_size=5)
                     | st.builds(lambda n: {f"x-junk-{i}": "v" for i in range(n)}, st.integers(100, 5000))),
        exclude_workers=draw(many(WORKERS, 20_000)), endpoint_subset=draw(many(WORKERS, 20_000)))
    try:
        req.body_json = body.decode("utf-8")
        data = req.SerializeToString()
    except UnicodeDecodeError:  # invalid UTF-8 (encoded surrogates, garbage): only the raw wire carries it
        data = req.SerializeToString() + ld(1, body)
    return data


def _cost_value(f: Any) -> st.SearchStrategy[Any]:
    """Mostly what the field takes, so a fair share of updates is accepted and what they set can be
    checked; else NaN, ±Inf, huge, subnormal, negative, out-of-range int64."""
    if f.cpp_type == f.CPPTYPE_INT64:
        valid: st.SearchStrategy[Any] = st.integers(1, 10**6)
        hostile: st.SearchStrategy[Any] = st.integers(-(2**63), 2**63 - 1) | st.sampled_from(
            [0, -1, MAX_INT, MAX_INT + 1, -MAX_INT - 1, 2**63 - 1, -(2**63), 10**15])
    else:
        valid = st.floats(0, 50) | st.sampled_from([0.0, -0.0, 5e-324, 1e-300, MAX_ABS])
        hostile = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from(
            [math.nan, -math.nan, math.inf, -math.inf, 1e308, -1e308, math.nextafter(MAX_ABS, math.inf), -MAX_ABS - 1,
             1e12, -1.0])
    return st.integers(0, 9).flatmap(lambda i: valid if i < 7 else hostile)


COST_FIELDS = list(ppb.CostParams.DESCRIPTOR.fields)
COST = st.lists(st.sampled_from(COST_FIELDS), unique_by=lambda f: f.name, max_size=4).flatmap(
    lambda fs: st.fixed_dictionaries({f.name: _cost_value(f) for f in fs}))
"""0-4 fields: none set is refused (empty_update), one to four are what an operator changes at once."""


@st.composite
def update_policy_request(draw: st.DrawFn) -> bytes:
    cost = draw(COST)
    req = ppb.UpdatePolicyRequest(cost=ppb.CostParams(**cost), reason=draw(PTEXT | st.just("r" * 5000)))
    return req.SerializeToString()


REQUESTS: dict[str, tuple[type[Message], type[Message]]] = {
    "/kvgate.v1.Routing/Explain": (rpb.ExplainRequest, rpb.ExplainResponse),
    "/kvgate.v1.Conversations/GetConversation": (cpb.GetConversationRequest, cpb.Conversation),
    "/kvgate.v1.Conversations/GetNextPrefix": (cpb.GetNextPrefixRequest, cpb.NextPrefix),
    "/kvgate.v1.Policy/GetPolicy": (ppb.GetPolicyRequest, ppb.PolicyState),
    "/kvgate.v1.Policy/UpdatePolicy": (ppb.UpdatePolicyRequest, ppb.UpdatePolicyResponse),
    "/kvgate.v1.Policy/ListPolicyChanges": (ppb.ListPolicyChangesRequest, ppb.ListPolicyChangesResponse),
    "/kvgate.v1.Fleet/ListWorkers": (fpb.ListWorkersRequest, fpb.ListWorkersResponse),
    "/grpc.health.v1.Health/Check": (health_pb2.HealthCheckRequest, health_pb2.HealthCheckResponse),
}
UPDATE = "/kvgate.v1.Policy/UpdatePolicy"
OPEN_METHODS = ("/grpc.health.v1.Health/",)


def message_for(method: str) -> st.SearchStrategy[bytes]:
    if method.endswith("/Explain"):
        return explain_request()
    if method.endswith("/UpdatePolicy"):
        return update_policy_request()
    if method.endswith("/GetConversation"):
        return st.builds(lambda i, t: cpb.GetConversationRequest(conversation_id=i, include_turns=t)
                         .SerializeToString(), IDS, st.booleans())
    if method.endswith("/GetNextPrefix"):
        return st.builds(lambda i, p, t: cpb.GetNextPrefixRequest(conversation_id=i, reasoning_policy=p,
                                                                  include_token_ids=t).SerializeToString(),
                         IDS, st.sampled_from(["", "keep", "drop", "truncate:1", "truncate:0", "truncate:-1",
                                               "truncate:²", "truncate:" + "9" * 5000, "TRUNCATE:3", " keep "])
                         | PTEXT, st.booleans())
    if method.endswith("/ListPolicyChanges"):
        return st.builds(lambda n: ppb.ListPolicyChangesRequest(limit=n).SerializeToString(),
                         st.integers(-(2**31), 2**31 - 1) | st.sampled_from([0, 1, -1, 256, 257]))
    if method.endswith("/ListWorkers"):
        return st.builds(lambda m: fpb.ListWorkersRequest(model=m).SerializeToString(),
                         st.sampled_from([MODEL, "", "other"]) | PTEXT)
    if method.endswith("/Check"):
        return st.builds(lambda s: health_pb2.HealthCheckRequest(service=s).SerializeToString(),
                         st.sampled_from(["", "kvgate.v1.Routing", "kvgate.v1.Policy", "nope"]) | PTEXT)
    return st.just(b"")


def resolve_text(s: str, side: Side) -> str:
    if "$" not in s:
        return s
    for i, w in enumerate(side.workers):
        s = s.replace(f"$w{i}", w)
    for i, e in enumerate(side.endpoints):
        s = s.replace(f"$e{i}", e)
    return s


def resolve_msg(data: bytes, msg: type[Message], side: Side) -> bytes:
    """The request with placeholder worker ids and endpoints as the side's own (only for one that
    parses; bent bytes are sent as they are)."""
    if b"$" not in data:
        return data
    m = parses(data, msg)
    if not isinstance(m, rpb.ExplainRequest) or m.SerializeToString() != data:
        return data
    ex = [resolve_text(x, side) for x in m.exclude_workers]
    sub = [resolve_text(x, side) for x in m.endpoint_subset]
    del m.exclude_workers[:]
    del m.endpoint_subset[:]
    m.exclude_workers.extend(ex)
    m.endpoint_subset.extend(sub)
    return m.SerializeToString()


# --- the control API: sending and checking --------------------------------------------------------------

BAD_CODES = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DATA_LOSS,
             grpc.StatusCode.DEADLINE_EXCEEDED}
REFUSED = {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED}


@dataclass
class Answer:
    code: grpc.StatusCode
    details: str
    trailing: dict[str, str]
    data: bytes | None


async def unary(ch: grpc.aio.Channel, method: str, data: bytes, md: tuple[tuple[str, str | bytes], ...],
                deadline_s: float = CALL_TIMEOUT_S) -> Answer:
    mc: Any = ch.unary_unary(method)  # no serializers: bytes go out and come back as they are
    try:
        out: bytes = await mc(data, metadata=md, timeout=deadline_s)
        return Answer(grpc.StatusCode.OK, "", {}, out)
    except grpc.aio.AioRpcError as exc:
        trailing = {k: v if isinstance(v, str) else repr(v) for k, v in exc.trailing_metadata() or ()}
        return Answer(exc.code(), exc.details() or "", trailing, None)


async def get_policy(side: Side) -> bytes:
    out = await unary(side.control, "/kvgate.v1.Policy/GetPolicy", b"", side.operator_md())
    assert out.code == grpc.StatusCode.OK and out.data is not None, out
    return out.data


def cost_bounded(cost: ppb.CostParams) -> list[tuple[str, float]]:
    return [(f.name, v) for f, v in cost.ListFields()
            if not (math.isfinite(v) and (abs(v) <= MAX_INT if isinstance(v, int) else abs(v) <= MAX_ABS))]


async def control(fleet: Fleet, side: Side, method: str, data: bytes, md: tuple[tuple[str, str | bytes], ...],
                  expect: str | None) -> Answer:
    tally = fleet.tally
    tally.requests["control"] += 1
    req_type, resp_type = REQUESTS.get(method, (ppb.GetPolicyRequest, ppb.PolicyState))
    data = resolve_msg(data, req_type, side)
    policy_before = log_before = None
    params_before = None
    if method == UPDATE:
        policy_before = await get_policy(side)
        params_before = side.gw.cost.params
        log_before = side.gw.policy_log.recent()
    t0 = time.monotonic()
    out = await unary(side.control, method, data, md)
    tally.seconds.append((time.monotonic() - t0, f"{side.name} {method} {len(data)} bytes {out.code.name}"))
    tally.codes[f"{method.rsplit('/', 1)[-1]} {out.code.name} {out.trailing.get('kvgate-error-code', '')}".strip()] += 1
    if len(fleet.replay_control) < 100 and method != UPDATE:
        fleet.replay_control.append((side, method, data, md))
    what = f"{side.name} {method} md={md!r:.200} data={data[:400]!r} ({len(data)} bytes)"
    check_answer(fleet, side, method, out, resp_type, expect, what, len(data), sum(len(k) + len(v) for k, v in md))
    if method == UPDATE:
        assert policy_before is not None and log_before is not None
        policy_after = await get_policy(side)
        log_after = side.gw.policy_log.recent()
        if out.code != grpc.StatusCode.OK:
            if policy_after != policy_before or side.gw.cost.params is not params_before:
                tally.find(f"a refused UpdatePolicy ({out.code.name}) changed the policy", what)
            if log_after != log_before:
                tally.find(f"a refused UpdatePolicy ({out.code.name}) was logged", what)
        elif out.data is not None:
            check_update(fleet, out.data, data, policy_after, log_before, log_after, what)
    return out


def check_answer(fleet: Fleet, side: Side, method: str, out: Answer, resp_type: type[Message], expect: str | None,
                 what: str, size: int, md_size: int) -> None:
    tally = fleet.tally
    if out.code in BAD_CODES:
        tally.find(f"{out.code.name}: {out.details[:300]}", what)
    elif out.code == grpc.StatusCode.OK:
        if out.data is None or parses(out.data, resp_type) is None:
            tally.find(f"{method} answered OK with bytes that are no {resp_type.__name__}", what)
    elif not out.details and not method.startswith(OPEN_METHODS):  # grpc's health: NOT_FOUND, no details
        tally.find(f"{out.code.name} without details", what)
    if out.code == grpc.StatusCode.UNAVAILABLE and out.trailing.get("kvgate-error-code") != "no_healthy_worker":
        tally.find(f"UNAVAILABLE {out.trailing}: {out.details[:200]}", what)
    if out.code == grpc.StatusCode.RESOURCE_EXHAUSTED and size <= GRPC_LIMIT and md_size < METADATA_SOFT \
            and out.trailing.get("kvgate-error-code") != "request_too_large":
        tally.find(f"RESOURCE_EXHAUSTED for a message within the limit: {out.details[:200]}", what)
    if method.startswith(OPEN_METHODS) or method not in REQUESTS:
        return  # open, or unknown (UNIMPLEMENTED before the auth hook, as gRPC answers)
    if side.secured and expect == "refused" and out.code not in REFUSED | {grpc.StatusCode.RESOURCE_EXHAUSTED}:
        tally.find(f"a caller without an operator's credentials got {out.code.name} from {method}", what)
    if (expect == "operator" or not side.secured) and out.code in REFUSED:
        tally.find(f"an operator was refused ({out.code.name}: {out.details[:100]})", what)


def check_update(fleet: Fleet, answer: bytes, sent: bytes, policy_after: bytes, log_before: list[Any],
                 log_after: list[Any], what: str) -> None:
    tally = fleet.tally
    resp = parses(answer, ppb.UpdatePolicyResponse)
    req = parses(sent, ppb.UpdatePolicyRequest)
    if not isinstance(resp, ppb.UpdatePolicyResponse) or not isinstance(req, ppb.UpdatePolicyRequest):
        tally.find("an accepted UpdatePolicy whose request or answer does not parse", what)
        return
    bad = cost_bounded(resp.state.cost)
    if bad:
        tally.find(f"UpdatePolicy accepted out-of-bounds values {bad[:3]}", what)
    if resp.state.SerializeToString() != policy_after:
        tally.find("UpdatePolicy answered a state GetPolicy does not show", what)
    asked = {f.name: v for f, v in req.cost.ListFields()}
    got = {f.name: v for f, v in resp.state.cost.ListFields()}
    wrong = {k: (v, got.get(k)) for k, v in asked.items() if got.get(k) != v}
    if wrong:
        tally.find(f"UpdatePolicy accepted but did not set {list(wrong.items())[:3]}", what)
    if not asked:
        tally.find("UpdatePolicy accepted a change of nothing", what)
    if len(log_after) != min(len(log_before) + 1, 256) or log_after[-1].via != "grpc":
        tally.find("an accepted UpdatePolicy was not logged", what)


# --- decision watchers ----------------------------------------------------------------------------------

@dataclass
class WatchRun:
    side: Side
    filter: rpb.WatchDecisionsRequest | None
    call: Any
    task: asyncio.Task[None]
    what: str
    expect: str | None
    events: list[rpb.DecisionEvent] = field(default_factory=list)


async def open_watch(fleet: Fleet, side: Side, data: bytes, md: tuple[tuple[str, str | bytes], ...],
                     expect: str | None, deadline: float | None) -> None:
    fleet.tally.requests["control"] += 1
    mc: Any = side.control.unary_stream("/kvgate.v1.Routing/WatchDecisions",
                                        response_deserializer=rpb.DecisionEvent.FromString)
    call = mc(
        data, metadata=md, timeout=deadline or 4 * CALL_TIMEOUT_S)
    flt = parses(data, rpb.WatchDecisionsRequest)
    what = f"{side.name} WatchDecisions md={md!r:.200} data={data[:300]!r}"
    run = WatchRun(side, flt if isinstance(flt, rpb.WatchDecisionsRequest) else None, call,
                   asyncio.ensure_future(asyncio.sleep(0)), what, expect)

    async def read() -> None:
        async for ev in call:
            run.events.append(ev)

    run.task = asyncio.ensure_future(read())
    fleet.watches.append(run)
    while len([w for w in fleet.watches if not w.task.done()]) > 6:  # a few open at a time, oldest closed
        await close_watch(fleet, next(w for w in fleet.watches if not w.task.done()))
    await asyncio.sleep(0.01)  # let it start: decisions made meanwhile reach it


async def close_watch(fleet: Fleet, run: WatchRun) -> None:
    run.call.cancel()
    code = grpc.StatusCode.CANCELLED
    details = ""
    try:
        await run.task
    except grpc.aio.AioRpcError as exc:
        code, details = exc.code(), exc.details() or ""
    except asyncio.CancelledError:
        pass
    if run.task.done() and not run.task.cancelled() and run.task.exception() is None:
        code = await run.call.code()
    fleet.tally.codes[f"watch {code.name}"] += 1
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        pass  # the short deadlines some watchers are given
    elif code in BAD_CODES:
        fleet.tally.find(f"WatchDecisions ended {code.name}: {details[:300]}", run.what)
    if run.side.secured and run.expect == "refused" and code not in REFUSED | {grpc.StatusCode.CANCELLED,
                                                                                grpc.StatusCode.DEADLINE_EXCEEDED}:
        fleet.tally.find(f"a watcher without an operator's credentials ended {code.name}", run.what)
    if run.side.secured and run.expect == "refused" and run.events:
        fleet.tally.find("a watcher without an operator's credentials saw decisions", run.what)
    f = run.filter
    for ev in run.events:
        if f is None:
            fleet.tally.find("a watcher whose request does not parse saw decisions", run.what)
            break
        if (f.model and ev.model != f.model) or (f.tenant and ev.tenant != f.tenant) \
                or (f.conversation_id and ev.conversation_id != f.conversation_id) \
                or (ev.scores and not f.include_scores):
            fleet.tally.find(f"a watcher saw a decision its filter leaves out: {ev}", run.what)
            break


# --- the endpoint picker: scripts -----------------------------------------------------------------------

@dataclass(frozen=True)
class Hdrs:
    response: bool
    items: tuple[tuple[str, bytes, bool], ...]
    """(name, value, as raw_value: else in ``value``, which must be UTF-8)."""
    end_of_stream: bool = False
    subset: Any = None
    """None: no hint; a list: the protocol's list of ``ip:port``; ("struct", value): another shape."""
    served: str | None = None
    config: tuple[int, int] | None = None
    observability: bool = False


@dataclass(frozen=True)
class Body:
    response: bool
    data: bytes
    end_of_stream: bool


@dataclass(frozen=True)
class Trailers:
    response: bool


@dataclass(frozen=True)
class Nothing:
    """A ProcessingRequest with no phase set."""


@dataclass(frozen=True)
class Bent:
    """A step whose serialized bytes are bent on the wire (``on_the_wire``)."""

    step: Any
    how: str
    seed: int


Step = Hdrs | Body | Trailers | Nothing | Bent


@dataclass(frozen=True)
class Script:
    steps: tuple[Step, ...]
    end: str = "close"
    """close: done writing, then read to the end; cancel:N: reset after the N-th write; hold: all
    written, the stream left open a moment, then reset (Envoy giving up)."""
    well_formed: bool = False
    endpoint: str = "chat"

    def subset(self) -> list[str] | None:
        for s in self.steps:
            if isinstance(s, Hdrs) and not s.response and isinstance(s.subset, list):
                return s.subset
        return None

    def describe(self) -> str:
        return f"end={self.end} steps=[{', '.join(_short(s) for s in self.steps)}]"



def _short(step: Step) -> str:
    """A step as a finding shows it: long values, bodies and lists cut, repeated headers counted."""
    if isinstance(step, Bent):
        return f"Bent({step.how}, {_short(step.step)})"
    if isinstance(step, Hdrs):
        items = [f"{k[:40]!r}: {v[:60]!r}{'' if raw else ' (value)'}" for k, v, raw in step.items[:14]]
        more = f", ... +{len(step.items) - 14} headers" if len(step.items) > 14 else ""
        sub = step.subset if not isinstance(step.subset, list) or len(step.subset) < 6 else \
            f"[{len(step.subset)} x {step.subset[0]!r}]"
        return (f"{'Response' if step.response else 'Request'}Headers({{{', '.join(items)}{more}}}, "
                f"eos={step.end_of_stream}, subset={sub!r:.80}, served={step.served!r:.40}, config={step.config}, "
                f"observability={step.observability})")
    if isinstance(step, Body):
        return (f"{'Response' if step.response else 'Request'}Body({step.data[:120]!r}"
                f"{f'... {len(step.data)} bytes' if len(step.data) > 120 else ''}, eos={step.end_of_stream})")
    return repr(step)


def header_map(items: tuple[tuple[str, bytes, bool], ...], side: Side) -> core.HeaderMap:
    hm = core.HeaderMap()
    for k, v, raw in items:
        v = resolve_text(v.decode("utf-8", "surrogateescape"), side).encode("utf-8", "surrogateescape") \
            if b"$" in v else v
        if raw:
            hm.headers.append(core.HeaderValue(key=k, raw_value=v))
        else:
            hm.headers.append(core.HeaderValue(key=k, value=v.decode("utf-8")))
    return hm


def struct_value(v: Any, side: Side) -> struct_pb2.Value:
    out = struct_pb2.Value()
    if isinstance(v, str):
        out.string_value = resolve_text(v, side)
    elif isinstance(v, bool):
        out.bool_value = v
    elif isinstance(v, int | float):
        out.number_value = float(v)
    elif v is None:
        out.null_value = struct_pb2.NULL_VALUE
    elif isinstance(v, list):
        out.list_value.values.extend(struct_value(x, side) for x in v)
    elif isinstance(v, tuple) and v and v[0] == "deep":
        inner = out
        for _ in range(v[1]):
            inner = inner.struct_value.fields["a"]
        inner.string_value = "x"
    elif isinstance(v, dict):
        for k, x in v.items():
            out.struct_value.fields[k].CopyFrom(struct_value(x, side))
    return out


def render(step: Step, side: Side) -> bytes:
    if isinstance(step, Bent):
        data = render(step.step, side)
        return bend(data, step.how, step.seed)
    req = ep.ProcessingRequest()
    if isinstance(step, Hdrs):
        h = ep.HttpHeaders(headers=header_map(step.items, side), end_of_stream=step.end_of_stream)
        (req.response_headers if step.response else req.request_headers).CopyFrom(h)
        if step.subset is not None:
            s = struct_pb2.Struct()
            if isinstance(step.subset, list):
                s.fields[proto.SUBSET].CopyFrom(struct_value(step.subset, side))
            else:
                s.fields[proto.SUBSET].CopyFrom(struct_value(step.subset[1], side))
            req.metadata_context.filter_metadata[proto.SUBSET_NS].CopyFrom(s)
        if step.served is not None:
            s = struct_pb2.Struct()
            s[proto.SERVED] = resolve_text(step.served, side)
            req.metadata_context.filter_metadata[proto.DESTINATION_NS].CopyFrom(s)
        if step.config is not None:
            req.protocol_config.request_body_mode = step.config[0]  # type: ignore[assignment]
            req.protocol_config.response_body_mode = step.config[1]  # type: ignore[assignment]
        req.observability_mode = step.observability
    elif isinstance(step, Body):
        b = ep.HttpBody(body=step.data, end_of_stream=step.end_of_stream)
        (req.response_body if step.response else req.request_body).CopyFrom(b)
    elif isinstance(step, Trailers):
        (req.response_trailers if step.response else req.request_trailers).CopyFrom(ep.HttpTrailers())
    return req.SerializeToString()


def bend(data: bytes, how: str, seed: int) -> bytes:
    """A fixed bend of ``data`` (the seed picks where), so a script renders the same every time."""
    n = len(data)
    if how == "truncate" and n:
        return data[:seed % n]
    if how == "garbage_tail":
        return data + bytes([(seed >> i) & 0xFF for i in range(0, 48, 8)])
    if how == "flip" and n:
        i = seed % n
        return data[:i] + bytes([(data[i] + 1 + seed % 255) & 0xFF]) + data[i + 1:]
    if how == "bad_utf8_key":  # a header whose key (a proto string) is invalid UTF-8
        return data + ld(2, ld(1, ld(1, ld(1, b"\xffx-bad"))))
    if how == "overlong_varint":
        return data + tag(1, 0) + b"\xff" * 10 + b"\x01"
    if how == "deep_groups":
        return data + tag(1999, 3) * 300 + tag(1999, 4) * 300
    if how == "only_garbage":
        return bytes([(seed * 31 + i * 7) & 0xFF for i in range(seed % 200)])
    return data


CONTENT_LENGTHS = st.sampled_from(["0", "1", "17", "-1", "1e3", " 5", "5 ", "+5", "0x10", "²", "١٢٣", "①",
                                   "9" * 30, "9" * 5000, "", "5, 5", str(MAX_BODY + 1), str(10**30)])
PATHS = st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/chat/completions?x=1", "/v1/models",
                         "//v1/chat/completions", "/V1/CHAT/COMPLETIONS", "/v1/chat/completions/", "", "/",
                         "/v1/chat/completions#", "/v1/embeddings", "*"]) | PTEXT
METHODS = st.sampled_from(["POST", "post", "GET", "PUT", "", "POST ", "CONNECT"]) | TEXT
ODD_BYTES = st.binary(max_size=40) | st.sampled_from([b"", b"\x00", b"\r\n", b"\xff\xfe", b"a" * 100_000,
                                                      "é".encode(), b"\xed\xa0\x80", b"gf-1\r\nx-tenant-id: other"])
FORGED = st.sampled_from([(proto.DESTINATION, b"10.9.9.9:8000"), (proto.DESTINATION, b"$e1"),
                          (proto.SUBSET, b"10.9.9.9:8000"), (proto.SERVED, b"$e0"),
                          ("x-gateway-model-name", b"other"), ("x-kvgate-worker", b"$w1"),
                          (proto.DESTINATION, b"")])
IDENTITY_HEADERS = st.sampled_from(["x-conversation-id", "x-session-id", "x-tenant-id", "x-kvgate-reasoning-policy",
                                    "X-Conversation-Id", "authorization", "x-api-key"])
IDENTITY_VALUES = st.sampled_from([b"wf-0", b"seed-1", TENANT.encode(), b"other", b"keep", b"truncate:3", b"bogus",
                                   b"gf/seed-1", f"Bearer {OPERATOR_KEY}".encode()]) | ODD_BYTES
SUBSETS = st.sampled_from([["$e0"], ["$e1"], ["$e0", "$e1"], [" $e0 "], ["$e0", "10.9.9.9:8000"]])
HOSTILE_SUBSETS = st.none() | SUBSETS | st.sampled_from([[], ["10.9.9.9:8000"], [""], ["$w0"], ["$e0,$e1"]]) \
    | st.lists(PTEXT, max_size=4) | st.builds(lambda n: ["$e0"] * n, st.integers(100, 20_000)) \
    | st.builds(lambda v: ("struct", v), st.sampled_from(
        ["$e0", 7, None, True, {"a": "$e0"}, [1, None, "$e0", {"x": 1}], ("deep", 50), ("deep", 150)]))
MODES = st.sampled_from([0, 4, 2]) | st.sampled_from([1, 3, 5, 99, -1])
"""Body send modes: NONE, FULL_DUPLEX_STREAMED, BUFFERED (served); STREAMED, BUFFERED_PARTIAL, GRPC,
values no proto names (refused with FAILED_PRECONDITION)."""


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    parts, last = [], 0
    for p in points:
        parts.append(data[last:p])
        last = p
    parts.append(data[last:])
    return [p for p in parts if p] or [b""]


def answer_body(chat: bool, sse: bool) -> bytes:
    """What a worker answers a well-formed request with (crafted: the picker reads it, it is no worker's)."""
    if sse:
        delta: dict[str, Any] = {"delta": {"content": "ok"}} if chat else {"text": "ok"}
        ev = {"id": "cmpl-gf", "object": "chat.completion.chunk", "model": MODEL, "choices": [{"index": 0, **delta}]}
        last: dict[str, Any] = {"delta": {}} if chat else {"text": ""}
        end = {**ev, "choices": [{"index": 0, "finish_reason": "stop", **last}],
               "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}}
        return f"data: {json.dumps(ev)}\n\ndata: {json.dumps(end)}\n\ndata: [DONE]\n\n".encode()
    choice = {"index": 0, "message": {"role": "assistant", "content": "ok"}} if chat else {"index": 0, "text": "ok"}
    return json.dumps({"id": "cmpl-gf", "object": "chat.completion", "model": MODEL,
                       "choices": [{**choice, "finish_reason": "stop"}],
                       "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}}).encode()


@st.composite
def response_phase(draw: st.DrawFn, chat: bool, hostile: bool) -> list[Step]:
    sse = draw(st.booleans())
    status = draw(st.sampled_from(["200"] * 6 + ["503", "400", "500", "204"])
                  | (st.sampled_from(["²", "9" * 5000, "-1", "abc", "", "200 OK", "2000", "99"]) if hostile
                     else st.nothing()))
    ctype = b"text/event-stream" if sse else b"application/json"
    items = [(":status", status.encode(), True), ("content-type", ctype, True)]
    served = draw(st.none() | (st.sampled_from(["$e0", "$e1", "10.9.9.9:8000", ""]) | PTEXT if hostile
                               else st.sampled_from(["$e0", "$e1"])))
    if draw(st.integers(0, 9)) == 0:
        return [Hdrs(True, tuple(items), end_of_stream=True, served=served)]
    body = answer_body(chat, sse)
    if hostile and draw(st.booleans()):
        body = draw(st.sampled_from([body[:-5], body + b"\xff\xfe", b"data: {\n\n", b"[" * 5000,
                                     b"data: " + b"[" * 5000 + b"\n\n", b"data: " + json.dumps(
                                         {"choices": "x", "usage": {"prompt_tokens": "9" * 5000}}).encode() + b"\n\n",
                                     json.dumps({"usage": {"prompt_tokens": 1e308}, "choices": [None]}).encode(),
                                     b"\x00" * 1000, b""]) | st.binary(max_size=200))
    parts = split(body, draw(st.lists(st.integers(0, 10**6), max_size=4)))
    steps: list[Step] = [Hdrs(True, tuple(items), served=served)]
    trailers = draw(st.integers(0, 4)) == 0
    steps += [Body(True, p, end_of_stream=not trailers and i == len(parts) - 1) for i, p in enumerate(parts)]
    if trailers:
        steps.append(Trailers(True))
    return steps


COUNTER = iter(range(10**9))
"""Fresh conversation ids for well-formed requests (a drawn one could conflict with a stored history)."""


@st.composite
def well_formed(draw: st.DrawFn) -> Script:
    """A request Envoy could send, with hostile extras kvgate does not read: it must get a pick."""
    chat = draw(st.booleans())
    body = json.dumps(draw(WELL_CHAT if chat else WELL_COMPLETION)).encode()
    # (NONE is left out: kvgate reads a 0 body mode as "not set", so it waits for a body NONE never sends.)
    mode = draw(st.sampled_from([None, (4, 4), (2, 2), (4, 2), (2, 4)]))
    items: list[tuple[str, bytes, bool]] = [
        (":method", b"POST", True), (":path", b"/v1/chat/completions" if chat else b"/v1/completions", True),
        (":authority", b"gateway.example", True), (":scheme", b"http", True),
        ("content-type", b"application/json", draw(st.booleans())),
        ("x-conversation-id", f"wf-{next(COUNTER) % 1000}-{draw(st.integers(0, 10**9))}".encode(), True),
        # The tenant's key (the secured gateway authenticates what Envoy passes on; the open one ignores it).
        ("authorization", f"Bearer {TENANT_KEY}".encode(), True)]
    if draw(st.booleans()):
        items.append(("content-length", str(len(body)).encode(), True))
    if draw(st.booleans()):
        items.append(("x-tenant-id", draw(st.sampled_from([TENANT, "other", "t.2"])).encode(), True))
    extras = draw(st.lists(FORGED | st.tuples(st.sampled_from(["x-junk", "X-Junk", "user-agent", "x-forwarded-for"]),
                                              ODD_BYTES), max_size=5))
    items += [(k, v, True) for k, v in extras]
    n = draw(st.integers(0, 9))
    if n == 0:  # many, or one repeated many times (folded as HTTP folds them)
        count = draw(st.integers(100, 30_000))
        items += [("x-many", b"v", True)] * count if draw(st.booleans()) else \
            [(f"x-many-{i}", b"v", True) for i in range(count)]
    subset = draw(st.none() | SUBSETS)
    steps: list[Step] = [Hdrs(False, tuple(items), subset=subset, config=mode)]
    # Envoy buffers the whole body in BUFFERED mode (the secured gateway's default): one message. Only an
    # explicit FULL_DUPLEX_STREAMED request body is split.
    if mode is None or mode[0] == 2:
        steps.append(Body(False, body, True))
    else:
        parts = split(body, draw(st.lists(st.integers(0, 10**6), max_size=5)))
        trailers = draw(st.integers(0, 5)) == 0
        steps += [Body(False, p, not trailers and i == len(parts) - 1) for i, p in enumerate(parts)]
        if trailers:
            steps.append(Trailers(False))
    if draw(st.booleans()):
        steps += draw(response_phase(chat, hostile=False))
    return Script(tuple(steps), end="close", well_formed=True, endpoint="chat" if chat else "completions")


@st.composite
def late_phases(draw: st.DrawFn) -> Script:
    """A request that gets its pick, then request phases Envoy never sends after the end of a request:
    the body's end again, more body, the headers again (as they came, or ending the stream)."""
    base = draw(well_formed())
    request = [st_ for st_ in base.steps if not getattr(st_, "response", False)]
    response = [st_ for st_ in base.steps if getattr(st_, "response", False)]
    headers = request[0]
    assert isinstance(headers, Hdrs)
    late: list[Step] = draw(st.lists(st.sampled_from([
        Body(False, b"", True), Body(False, b"", True), Body(False, b"{}", True), Body(False, b" ", False),
        headers, Hdrs(False, headers.items, end_of_stream=True), Trailers(False)]), min_size=1, max_size=3))
    steps: list[Step] = [*request, *late, *(response if draw(st.booleans()) else [])]
    return Script(tuple(steps), end=draw(st.sampled_from(["close", "close", "hold"])), endpoint=base.endpoint)


@st.composite
def request_headers(draw: st.DrawFn, path: str) -> Hdrs:
    """Hostile headers; mostly with the method, path and a credential right, so the hostile bodies behind
    them are read and judged rather than passed on unread (or refused 401 by the secured gateway)."""
    items: list[tuple[str, bytes, bool]] = []
    if draw(st.integers(0, 3)):
        items += [(":method", b"POST", True), (":path", path.encode(), True)]
        items.append(("authorization", draw(st.sampled_from([f"Bearer {TENANT_KEY}", f"Bearer {OPERATOR_KEY}"]))
                      .encode(), True))
    else:
        if draw(st.integers(0, 5)):
            items.append((":method", draw(METHODS).encode(), True))
        if draw(st.integers(0, 5)):
            items.append((":path", draw(PATHS).encode(), draw(st.booleans())))
    if draw(st.booleans()):
        items.append(("content-length", draw(CONTENT_LENGTHS).encode(), draw(st.booleans())))
    for k, v in draw(st.lists(st.tuples(IDENTITY_HEADERS, IDENTITY_VALUES), max_size=3)):
        items.append((k, v, True))
    items += [(k, v, True) for k, v in draw(st.lists(FORGED, max_size=3))]
    for k, v in draw(st.lists(st.tuples(st.sampled_from(["x-a", "X-A", "", " ", ":", "x\x00y", "é", "x" * 5000])
                                        | TEXT, ODD_BYTES), max_size=4)):
        items.append((k, v, True))
    if draw(st.integers(0, 9)) == 0:  # one name repeated (folded into one line), up to the message limit
        count = draw(st.sampled_from([100, 5_000, 50_000, 200_000]) | st.integers(100, 200_000))
        items += [(draw(st.sampled_from(["x-conversation-id", "x-many", "content-length"])), b"1", True)] * count
    if draw(st.booleans()):
        draw(st.randoms()).shuffle(items)
    cfg = draw(st.integers(0, 2).flatmap(lambda i: st.tuples(MODES, MODES) if i == 0 else st.none()))
    return Hdrs(False, tuple(items), end_of_stream=draw(st.integers(0, 4)) == 0, subset=draw(HOSTILE_SUBSETS),
                config=cfg, observability=draw(st.integers(0, 19)) == 0)


@st.composite
def hostile_script(draw: st.DrawFn) -> Script:
    if draw(st.integers(0, 5)) == 0:
        return draw(late_phases())
    chat = draw(st.booleans())
    how = draw(st.integers(0, 9))
    if how < 4:
        body = draw(encoded(draw(mutated(CHAT if chat else COMPLETION))))
    elif how < 6:
        body = json.dumps(draw(WELL_CHAT if chat else WELL_COMPLETION)).encode()
    elif how < 7:
        body = draw(st.binary(max_size=300))
    elif how < 8:
        body = b'{"model": "' + b"m" * draw(st.integers(MAX_BODY - 100, MAX_BODY + 100)) + b'"}'
    else:
        body = b""
    parts = split(body, draw(st.lists(st.integers(0, 10**7), max_size=5)))
    eos = draw(st.sampled_from(["last"] * 5 + ["none", "first", "every", "twice"]))
    bodies: list[Step] = []
    for i, p in enumerate(parts):
        end = {"last": i == len(parts) - 1, "none": False, "first": i == 0, "every": True,
               "twice": i == len(parts) - 1}[eos]
        bodies.append(Body(False, p, end))
    if eos == "twice":
        bodies.append(Body(False, draw(st.sampled_from([b"", b"", b"", b"{}", parts[-1]])), True))
    headers = draw(request_headers("/v1/chat/completions" if chat else "/v1/completions"))
    order = draw(st.sampled_from(["headers_first"] * 6 + ["body_first", "headers_twice", "no_headers",
                                                          "trailers", "shuffled"]))
    steps: list[Step]
    if order == "headers_first":
        steps = [headers, *bodies]
    elif order == "body_first":
        steps = [*bodies, headers]
    elif order == "headers_twice":
        steps = [headers, *bodies, headers, *bodies[-1:]]
    elif order == "no_headers":
        steps = list(bodies)
    elif order == "trailers":
        steps = [headers, *bodies, Trailers(False), Trailers(False)]
    else:
        steps = [headers, *bodies, Trailers(False), Nothing()]
        draw(st.randoms()).shuffle(steps)
    if draw(st.booleans()):
        steps += draw(response_phase(chat, hostile=True))
    if draw(st.integers(0, 9)) == 0:
        steps.insert(draw(st.integers(0, len(steps))), Nothing())
    if draw(st.integers(0, 4)) == 0:  # a message broken on the wire
        i = draw(st.integers(0, len(steps) - 1))
        steps[i] = Bent(steps[i], draw(st.sampled_from(["truncate", "garbage_tail", "flip", "bad_utf8_key",
                                                        "overlong_varint", "deep_groups", "only_garbage"])),
                        draw(st.integers(0, 2**32)))
    ending = draw(st.sampled_from(["close"] * 6 + ["hold", "cancel"]))
    if ending == "cancel":
        ending = f"cancel:{draw(st.integers(0, len(steps)))}"
    return Script(tuple(steps), end=ending, endpoint="chat" if chat else "completions")


# --- the endpoint picker: running and checking ----------------------------------------------------------

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


def check_stream(fleet: Fleet, side: Side, script: Script, res: StreamResult, what: str, pickable: bool) -> None:
    tally = fleet.tally
    subset, unsupported, malformed, oversize = step_flags(script)
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
    endpoints = set(side.endpoints)
    pick: str | None = None
    new_body = b""
    length: str | None = None
    removed: list[str] = []
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
            if pick is not None:
                tally.find("two picks in one stream", what)
            pick = header
            common = r.request_headers.response if r.HasField("request_headers") else r.request_body.response
            for o in common.header_mutation.set_headers:
                if o.header.key == "content-length":
                    length = o.header.raw_value.decode()
            removed = list(common.header_mutation.remove_headers)
            if r.HasField("request_body"):
                new_body = common.body_mutation.body
        elif pick is not None and r.HasField("request_body"):
            new_body += r.request_body.response.body_mutation.streamed_response.body
    if not script.well_formed or res.code != grpc.StatusCode.OK:
        return
    if pick is None and not pickable:
        tally.codes["epp well-formed while a worker was ejected"] += 1
        return
    if pick is None:
        tally.find(f"a well-formed request got no pick ({len(res.responses)} answers: "
                   f"{[parses(x, ep.ProcessingResponse) for x in res.responses][:2]!r:.400})", what)
        return
    primary = pick.split(",")[0]
    allowed_subset = script.subset()
    if allowed_subset is not None:
        ok = {resolve_text(s, side).strip() for s in allowed_subset}
        if not set(pick.split(",")) <= ok:
            tally.find(f"a pick outside the subset Envoy allowed: {pick} not in {sorted(ok)}", what)
    if length is not None:
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
    if side.secured and "authorization" not in removed:
        tally.find("the client's credential was passed on to the worker", what)
    if primary not in endpoints:
        tally.find(f"picked {primary}, not an endpoint of the pool", what)


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


async def settled(pred: Callable[[], bool], within_s: float) -> bool:
    """Whether ``pred`` holds, now or within ``within_s``."""
    for _ in range(int(within_s / 0.01) + 1):
        if pred():
            return True
        await asyncio.sleep(0.01)
    return pred()


def rss_mib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) // 1024
    return 0


async def seed(side: Side) -> None:
    """Two conversations with a completed turn each, for the conversation reads to find."""
    headers = {"authorization": f"Bearer {TENANT_KEY}"} if side.secured else {}
    async with httpx.AsyncClient(timeout=30) as h:
        for cid in ("seed-1", "seed-2"):
            r = await h.post(side.cluster.url + "/v1/chat/completions", headers={**headers, "x-conversation-id": cid},
                             json={"model": MODEL, "max_tokens": 4,
                                   "messages": [{"role": "user", "content": f"hello {cid}"}]})
            assert r.status_code == 200, r.text


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
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
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
