"""Headers and credentials the fuzz sends: raw header bytes, content types, API keys, drawn JWT claims."""

from __future__ import annotations

import base64
import time
from dataclasses import dataclass
from typing import Any

import jwt
from hypothesis import strategies as st

from tests.httpfuzz.fleet import NOROLE_KEY, OPERATOR_KEY, TENANT_KEY, Fleet
from tests.httpfuzz.strategies import FLOATS, HOSTILE_TEXT, INTS, TEXT

# Headers: raw bytes (obs-text 0x80-0xff is legal in HTTP/1.1 field values; CR, LF and NUL are not and the
# client refuses them before they leave).
# Nor leading or trailing blanks.
HEADER_VALUE = (st.binary(max_size=40).map(lambda b: bytes(c for c in b if c >= 0x20 and c != 0x7f))
                | st.sampled_from([b"", b"fz-1", b"\xff\xfe", b"a" * 8000, "é".encode(), b"tenant/../x", b"Bearer",
                                   b"Bearer a.b.c", b"Bearer ...", b"Basic Zm9vOmJhcg==", b"-1",
                                   b"99999999999999999999", b"Bearer  x"])).map(lambda b: b.strip(b" \t"))
HEADER_NAMES = ["x-conversation-id", "x-session-id", "x-tenant-id", "x-request-id", "traceparent", "tracestate",
                "x-kvgate-reasoning-policy", "priority", "x-priority", "x-api-key", "accept", "accept-encoding",
                "user-agent", "x-forwarded-for", "transfer-encoding-x"]
CONTENT_TYPES = st.sampled_from([b"application/json", b"application/json; charset=utf-16", b"text/plain",
                                 b"multipart/form-data; boundary=x", b"application/x-www-form-urlencoded", b"",
                                 b"\xff/\xfe"])


@st.composite
def headers(draw: st.DrawFn) -> dict[str, bytes]:
    h = {name: draw(HEADER_VALUE) for name in draw(st.lists(st.sampled_from(HEADER_NAMES), max_size=4,
                                                              unique=True))}
    if draw(st.booleans()):
        h["content-type"] = draw(CONTENT_TYPES)
    return h


@dataclass(frozen=True)
class Credential:
    """What the secured gateway is shown: a key, a JWT whose claims are drawn, a malformed token, or none."""

    kind: str
    value: Any = None


CLAIM_VALUES = st.sampled_from(["fz", "operator", "tenant", ["tenant", "operator"], [], 7, None, {"id": "fz"}]) \
    | HOSTILE_TEXT.filter(lambda s: len(s) < 2000) | INTS | FLOATS.filter(lambda f: f == f and abs(f) < 1e300)
CREDENTIALS = (st.just(Credential("key", TENANT_KEY)) | st.just(Credential("key", TENANT_KEY))
               | st.just(Credential("key", OPERATOR_KEY)) | st.just(Credential("key", NOROLE_KEY))
               | st.builds(Credential, st.just("raw"), HEADER_VALUE)
               | st.builds(Credential, st.just("jwt"), st.fixed_dictionaries(
                   {"org": st.fixed_dictionaries({"id": CLAIM_VALUES}) | CLAIM_VALUES},
                   optional={"roles": CLAIM_VALUES, "exp": INTS | FLOATS.filter(lambda f: f == f),
                             "nbf": INTS, "iat": INTS | TEXT, "aud": CLAIM_VALUES, "iss": CLAIM_VALUES}))
               | st.just(Credential("none")))


def credential_headers(fleet: Fleet, c: Credential) -> dict[str, bytes]:
    if c.kind == "key":
        return {"authorization": f"Bearer {c.value}".encode()}
    if c.kind == "raw":
        return {"authorization": c.value}
    if c.kind == "jwt":
        claims = dict(c.value)
        claims.setdefault("exp", int(time.time()) + 600)
        try:
            token = jwt.encode(claims, fleet.jwt_key, algorithm="RS256", headers={"kid": "fz"})
        except (TypeError, ValueError, OverflowError):  # claims PyJWT will not even encode: send them raw
            body = base64.urlsafe_b64encode(repr(claims).encode()).rstrip(b"=").decode()
            token = f"eyJhbGciOiJSUzI1NiJ9.{body}.c2ln"
        return {"authorization": f"Bearer {token}".encode()}
    return {}
