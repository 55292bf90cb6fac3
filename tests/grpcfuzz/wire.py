"""The wire, for tests/test_grpc_fuzz.py: protobuf written by hand and bent (``on_the_wire``), the
credentials a call shows the auth hook (``Cred``, ``metadata``), and a raw unary call (``unary``)."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
import jwt
from google.protobuf.message import DecodeError, Message
from hypothesis import strategies as st

from tests.grpcfuzz.fleet import CALL_TIMEOUT_S, NOROLE_KEY, OPERATOR_KEY, TENANT, TENANT_KEY, jwks
from tests.httpfuzz.strategies import TEXT

if TYPE_CHECKING:
    from tests.grpcfuzz.fleet import Fleet

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
    | st.binary(min_size=1, max_size=20).filter(lambda b: not is_utf8(b))


def is_utf8(b: bytes) -> bool:
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


# --- calls ----------------------------------------------------------------------------------------------

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
