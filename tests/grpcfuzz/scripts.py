"""The endpoint picker's scripts in tests/test_grpc_fuzz.py: the ext_proc messages of one stream (``Script``
of ``Step``s), rendered as bytes (``render``), and drawn: requests Envoy could send (``well_formed``) and
hostile ones (``hostile_script``)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from google.protobuf import struct_pb2
from hypothesis import strategies as st

from kvgate.epp import protocol as proto
from kvgate.grpc.gen.envoy.config.core.v3 import base_pb2 as core
from kvgate.grpc.gen.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from tests.conftest import MODEL
from tests.grpcfuzz.control import PTEXT, WELL_CHAT, WELL_COMPLETION, resolve_text
from tests.grpcfuzz.fleet import OPERATOR_KEY, TENANT, TENANT_KEY, Side
from tests.grpcfuzz.wire import ld, tag
from tests.httpfuzz.strategies import CHAT, COMPLETION, MAX_BODY, TEXT, encoded, mutated

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
