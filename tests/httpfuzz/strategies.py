"""Hostile JSON for the fuzz (tests/test_fuzz*.py, tests/grpcfuzz): odd text and numbers, deep and huge values,
valid chat and completion bodies, structure-aware mutations of them and wire encodings that break them."""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Iterator
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import MODEL

MAX_BODY = 1024 * 1024
"""The gateways' body limit: smaller than the default 8 MiB so an oversized body costs the fuzz little."""


SURROGATES = st.sampled_from(["\ud800", "\udfff", "\udbff\udc00"[:1], "a\udc80b"])
ODD_TEXT = st.sampled_from(["", " ", "\x00", "\u0000\u0001\u001f", "\ufeff", "\u202e", "\uffff", "\U0010ffff",
                            "é", "🙂" * 3, "<|im_start|>", "<think>", "</think>", "{{ 7*7 }}", "{% raw %}",
                            "\r\n", "../../etc/passwd", "null", "%00", "a/b", "kvgate-tiny\x00"])
TEXT = st.text(max_size=40) | ODD_TEXT
HUGE_TEXT = st.builds(lambda c, n: c * n, st.sampled_from(["a", "é", "🙂", "\x00", " ", "<|im_end|>"]),
                      st.integers(0, 300_000))
HOSTILE_TEXT = TEXT | SURROGATES | HUGE_TEXT
INTS = st.integers(-(2**63), 2**63) | st.integers(-(10**99), 10**99) | st.sampled_from([0, -1, 1, 2**31, 2**64])
FINITE = st.floats(allow_nan=False, allow_infinity=False) | st.sampled_from([-0.0, 1e308, -1e308, 5e-324])
FLOATS = FINITE | st.sampled_from([float("nan"), float("inf"), float("-inf")])


def nest(depth: int, obj: bool) -> Any:
    v: Any = 1
    for _ in range(depth):
        v = {"a": v} if obj else [v]
    return v


DEEP = st.builds(nest, st.integers(1, 600), st.booleans())
# Values a mutation puts in are mostly valid JSON (finite numbers, no lone surrogates), so a mutated request
# gets past the parser to the checks behind it; NaN, Infinity and lone surrogates come one in ten, and from
# the encodings below.
SCALARS = st.none() | st.booleans() | INTS | FINITE | TEXT | HUGE_TEXT
ANY_JSON = st.recursive(st.none() | st.booleans() | INTS | FINITE | TEXT,
                        lambda ch: st.lists(ch, max_size=4) | st.dictionaries(TEXT, ch, max_size=4),
                        max_leaves=12)
NOT_JSON = FLOATS.filter(lambda f: not math.isfinite(f)) | SURROGATES
HOSTILE = st.integers(0, 9).flatmap(lambda i: NOT_JSON if i == 0 else (
    SCALARS | ANY_JSON | DEEP | st.builds(lambda n: ["x"] * n, st.integers(0, 5000))
    | st.builds(lambda n: {f"k{i}": i for i in range(n)}, st.integers(0, 5000))))

CONV_IDS = st.sampled_from(["fz-1", "fz-2", "fz-3", "fz/4", "FZ-5"]) | HOSTILE_TEXT
ROLES = st.sampled_from(["system", "developer", "user", "assistant", "tool", "function"])


@st.composite
def tool_call(draw: st.DrawFn) -> dict[str, Any]:
    args = draw(st.sampled_from(['{"path": "a"}', "{}", "", "[[[[", '{"a": NaN}', '"\\ud800"'])
                | st.builds(json.dumps, st.dictionaries(st.text(max_size=5), st.integers(), max_size=3))
                | st.builds(lambda d: "[" * d + "]" * d, st.integers(1, 5000)))
    return {"id": draw(st.sampled_from(["call_1", "call_2"]) | TEXT), "type": "function",
            "function": {"name": draw(st.sampled_from(["read", "bash"]) | TEXT), "arguments": args}}


@st.composite
def message(draw: st.DrawFn) -> dict[str, Any]:
    role = draw(ROLES)
    m: dict[str, Any] = {"role": role}
    content = draw(st.sampled_from(["hi", "investigate", "ok"]) | TEXT
                   | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}), max_size=3)
                   | st.none())
    m["content"] = content
    if role == "assistant" and draw(st.booleans()):
        m["tool_calls"] = draw(st.lists(tool_call(), min_size=1, max_size=2))
    if role == "assistant" and draw(st.booleans()):
        m["reasoning_content"] = draw(TEXT)
    if role == "tool":
        m["tool_call_id"] = draw(st.sampled_from(["call_1", "call_2"]) | TEXT)
    if draw(st.integers(0, 9)) == 0:
        m["name"] = draw(TEXT)
    return m


TOOLS = st.lists(st.fixed_dictionaries({
    "type": st.just("function"),
    "function": st.fixed_dictionaries({"name": st.sampled_from(["read", "bash"]),
                                       "parameters": st.just({"type": "object", "properties": {}})})}), max_size=2)

COMMON_OPTIONAL: dict[str, st.SearchStrategy[Any]] = {
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans(),
                                                          "continuous_usage_stats": st.booleans()}),
    "max_tokens": st.integers(1, 8),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "n": st.just(1),
    "seed": st.integers(0, 2**31),
    "stop": st.lists(TEXT, max_size=2) | TEXT,
    "user": TEXT,
    "logprobs": st.booleans(),
    "conversation_id": CONV_IDS,
    "sim": st.fixed_dictionaries({}, optional={"reasoning_tokens": st.integers(0, 8),
                                               "tool_calls": st.integers(0, 2)}),
    "cache_salt": TEXT,
}
CHAT_OPTIONAL: dict[str, st.SearchStrategy[Any]] = {
    **COMMON_OPTIONAL,
    "max_completion_tokens": st.integers(1, 8),
    "tools": TOOLS,
    "tool_choice": st.sampled_from(["auto", "none", "required"]),
    "reasoning_policy": st.sampled_from(["keep", "drop", "truncate:4", "truncate:-1", "truncate:x", "bogus"]),
    "return_token_ids": st.booleans(),
    "previous_response_id": st.just("$known") | TEXT,
    "chat_template_kwargs": st.fixed_dictionaries({}, optional={"enable_thinking": st.booleans()}),
    "response_format": st.just({"type": "json_object"}),
}

# Now and then thousands of messages: validated and rendered off the event loop past 512.
MESSAGES = st.integers(0, 29).flatmap(lambda i: st.lists(message(), min_size=1, max_size=5) if i else st.builds(
    lambda ms, n: (ms * n)[:n], st.lists(message(), min_size=1, max_size=3), st.integers(500, 3000)))
CHAT = st.fixed_dictionaries({"model": st.just(MODEL), "messages": MESSAGES}, optional=CHAT_OPTIONAL)
COMPLETION = st.fixed_dictionaries(
    {"model": st.just(MODEL),
     "prompt": TEXT | st.lists(TEXT, min_size=1, max_size=3) | st.lists(st.integers(-5, 70_000), min_size=1,
                                                                          max_size=40)},
    optional={**COMMON_OPTIONAL, "echo": st.booleans(), "suffix": TEXT, "best_of": st.integers(0, 3)})


def paths(doc: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every place in ``doc`` a mutation may hit (the root included)."""
    yield prefix
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from paths(v, (*prefix, i))


def put(doc: Any, path: tuple[Any, ...], op: str, value: Any) -> Any:
    if not path:
        return value if op != "delete" else {}
    parent = doc
    for p in path[:-1]:
        parent = parent[p]
    last = path[-1]
    if op == "delete":
        del parent[last]
    elif op == "wrap":
        parent[last] = [parent[last]]
    elif op == "extra" and isinstance(parent, dict):
        parent[f"x_{len(parent)}"] = value
    else:
        parent[last] = value
    return doc


@st.composite
def mutated(draw: st.DrawFn, base: st.SearchStrategy[dict[str, Any]]) -> Any:
    """A valid document with 0-3 structure-aware mutations: any field (nested ones too) replaced by a value
    of another type, a huge, deep or odd one, deleted, wrapped in a list, or joined by an unknown field."""
    doc: Any = copy.deepcopy(draw(base))  # st.just() values are shared between draws: never mutate them
    for _ in range(draw(st.integers(0, 3))):
        ps = list(paths(doc))
        path = ps[draw(st.integers(0, len(ps) - 1))]
        op = draw(st.sampled_from(["replace", "replace", "delete", "wrap", "extra"]))
        doc = put(doc, path, op, draw(HOSTILE))
    return doc


@st.composite
def encoded(draw: st.DrawFn, doc: Any) -> bytes:
    """``doc`` as bytes, mostly as a client would send it, sometimes broken on the wire."""
    how = draw(st.sampled_from(["plain"] * 36 + ["ascii", "surrogatepass", "lone_surrogate", "bom", "utf16",
                                                  "truncate", "garbage", "empty", "huge_number", "nan_literal",
                                                  "duplicate_keys", "padding"]))

    def dumps(ascii_: bool) -> str:
        # allow_nan: Python writes NaN / Infinity literals, which are not JSON (the gateway must refuse them).
        return json.dumps(doc, ensure_ascii=ascii_, allow_nan=True)

    try:
        text = dumps(how == "ascii")
    except (ValueError, RecursionError):
        text = "[" * 2000 + "]" * 2000
    if how == "surrogatepass":
        return text.encode("utf-8", "surrogatepass")
    data = text.encode("utf-8", "surrogatepass") if how != "ascii" else text.encode()
    if how == "bom":
        return b"\xef\xbb\xbf" + data
    if how == "utf16":
        return text.encode("utf-16", "surrogatepass")
    if how == "truncate":
        return data[: draw(st.integers(0, max(0, len(data) - 1)))]
    if how == "garbage":
        return draw(st.binary(max_size=200))
    if how == "empty":
        return b""
    if how == "huge_number":
        return data.replace(b'"model"', b'"n": ' + b"9" * draw(st.integers(50, 5000)) + b', "model"', 1)
    if how == "lone_surrogate":  # a valid escape of an invalid code point, in the first string value
        return data.replace(b': "', b': "\\udc00', 1)
    if how == "nan_literal":
        return data.replace(b'"model"', b'"temperature": NaN, "model"', 1)
    if how == "duplicate_keys":
        return data.replace(b'"model"', b'"model": 1, "model"', 1)
    if how == "padding":
        return b" " * draw(st.integers(0, MAX_BODY + 16)) + data
    return data


FUZZ = settings(derandomize=True, database=None, deadline=None, print_blob=False,
                suppress_health_check=list(HealthCheck))


def drawn_bodies(edge_cases: list[Any], bases: st.SearchStrategy[dict[str, Any]], n: int) -> list[bytes]:
    """A door's fuzz corpus: its hand-written edge cases, then ``n`` derandomized mutations of ``bases``
    (shared by tests/test_fuzz_messages.py and tests/test_fuzz_responses.py)."""
    bodies: list[bytes] = [json.dumps(d).encode() for d in edge_cases]

    @given(doc=mutated(bases), data=st.data())
    def draw(doc: Any, data: st.DataObject) -> None:
        bodies.append(data.draw(encoded(doc)))

    settings(FUZZ, max_examples=n)(draw)()
    return bodies
