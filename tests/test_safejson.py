"""``safejson.loads`` parses with orjson where that gives what the stdlib path gives: every document, hostile
or not, must get the very answer of ``stdlib_loads`` (the reference: kvgate's answers before orjson), the
same value with the same types, or the same refusal with the same reason."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgate import safejson
from kvgate.safejson import JsonLimits, JsonRejected, stdlib_loads
from tests.test_hostile import HOSTILE


def answer(f: Any, data: bytes | str, limits: JsonLimits) -> tuple[str, str]:
    try:
        return "ok", repr(f(data, limits))  # repr: 2**64 and 2.0**64 are == but not the same document
    except JsonRejected as exc:
        return "rejected", exc.reason


CASES: list[bytes] = [
    b'{"a":1,"b":2,"a":3}',  # duplicate keys: the last value, in the first's place
    b'{"a":1234567890123456789012345}', b'{"a":18446744073709551616}', b'{"a":-9223372036854775809}',
    b'{"a":9223372036854775807}', b'{"a":-9223372036854775808}', b'[18446744073709551615]',
    b'{"a":' + b"9" * 5000 + b"}", b'{"a":1.' + b"1" * 200 + b"}", b'{"a":1.' + b"1" * 90 + b"}",
    b'{"a":1e999}', b'{"a":-1e400}', b'{"a":1e-999}', b'{"a":1.5e308}', b'{"a":-0}', b'{"a":-0.0}',
    b'{"a":NaN}', b'{"a":Infinity}', b'{"a":-Infinity}',
    b"[" * 64 + b"]" * 64, b"[" * 65 + b"]" * 65, b'{"a":' * 64 + b"1" + b"}" * 64,
    b'{"a":' * 65 + b"1" + b"}" * 65, b"[" * 2000 + b"]" * 2000,
    b'{"a":"\\ud800"}', b'{"a":"x\\udc00y"}', b'{"a":"\\ud83d\\ude00"}', b'{"\\ud800":1}',
    b'{"a":"\xed\xa0\x80"}', b'{"a":"\xff"}', b'{"a":"\xc0\xaf"}', b'\xef\xbb\xbf{"a":1}', b'{"a":"x\x01y"}',
    b'{"a":1,}', b'{"a":1} x', b'{"a":01}', b"{'a':1}", b"", b" ", b'\x0c{"a":1}', b'{"a":1}\x00',
    b'{"a":"\\u0000"}', b'"' + b"1" * 40 + b'"', b'{"id":"' + b"7" * 19 + b'","n":1}', b"1" * 101, b"1" * 18,
    b'{"a": [1, 2.5, "\\u00e9"]}', b' \t\r\n{"a" : [ ] }\n', b"null", b"true", b"[1e5, 1E-5, 0.5e+3]",
    *(body for _, body in HOSTILE),
]


@pytest.mark.parametrize("data", CASES)
@pytest.mark.parametrize("limits", [JsonLimits(), JsonLimits(max_depth=2, max_number_chars=20)])
def test_hostile_documents_get_the_stdlib_paths_answer(data: bytes, limits: JsonLimits) -> None:
    assert answer(safejson.loads, data, limits) == answer(stdlib_loads, data, limits)
    try:
        text = data.decode()
    except UnicodeDecodeError:
        return
    assert answer(safejson.loads, text, limits) == answer(stdlib_loads, text, limits)


NUMBERS = st.one_of(st.integers(min_value=-(2**200), max_value=2**200).map(str),
                    st.floats(allow_nan=False, allow_infinity=False).map(repr),
                    st.from_regex(r"-?(0|[1-9][0-9]{0,40})(\.[0-9]{1,40})?([eE][+-]?[0-9]{1,4})?", fullmatch=True))
STRINGS = st.text(max_size=30).map(lambda s: json.dumps(s, ensure_ascii=False))
SCALARS = st.one_of(NUMBERS, STRINGS, st.sampled_from(["true", "false", "null", '"\\ud800"', "NaN", '"\\u00e9"']))
DOCS = st.recursive(SCALARS, lambda kids: st.one_of(
    st.lists(kids, max_size=4).map(lambda xs: "[" + ",".join(xs) + "]"),
    st.lists(st.tuples(STRINGS, kids), max_size=4).map(lambda kv: "{" + ",".join(f"{k}:{v}" for k, v in kv) + "}")),
    max_leaves=20)


@settings(max_examples=400, derandomize=True, deadline=None)
@given(DOCS, st.sampled_from([JsonLimits(), JsonLimits(max_depth=3, max_number_chars=20)]))
def test_generated_documents_get_the_stdlib_paths_answer(doc: str, limits: JsonLimits) -> None:
    assert answer(safejson.loads, doc.encode("utf-8", "surrogatepass"), limits) == \
        answer(stdlib_loads, doc.encode("utf-8", "surrogatepass"), limits)
