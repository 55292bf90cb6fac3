"""JSON from untrusted clients, parsed so that no document can crash or stall what reads it.

Python's ``json`` accepts what later code cannot handle: ``NaN``/``Infinity`` (poison for arithmetic and
for the policy's coefficients), lone surrogates such as ``"\\ud800"`` (valid JSON escapes that no UTF-8
encoder, tokenizer or HTTP client will take), integers of thousands of digits (``int()`` refuses past
4,300 and arithmetic on them is slow), and nesting deep enough that recursive consumers (templates,
validators, ``json.dumps``) overflow the stack. ``loads`` refuses all of them up front with
``JsonRejected``, which every entry point turns into an OpenAI-style 400; nothing past it has to care.

Parsed by orjson (a quarter of the stdlib parser's CPU with kvgate's hooks and checks) when that gives
the very document the stdlib path would: orjson refuses NaN/Infinity, out-of-range numbers, invalid UTF-8
and lone surrogates by itself and keeps duplicate keys as ``json`` does (the last value, in the first's
place), but reads an integer past 64 bits as a float and takes number literals of any length; a document
that might hold either, nests deeper than the limit, or that orjson refuses, is parsed by the stdlib path,
so every refusal and every accepted value is what it always was (tests/test_safejson.py).

Pure: no I/O, no state; limits come in as a ``JsonLimits``.
"""

from __future__ import annotations

import json
from typing import Any

import orjson
from pydantic import BaseModel, ConfigDict, Field


class JsonLimits(BaseModel):
    """Limits on untrusted JSON (``hostile.json`` in the settings)."""

    model_config = ConfigDict(extra="forbid")

    max_depth: int = Field(64, ge=2, le=512)
    """Nesting of arrays and objects; OpenAI requests need under 10, tool schemas rarely 20."""
    max_number_chars: int = Field(100, ge=20, le=4000)
    """Characters of one number literal (a float's 17 significant digits and exponent fit many times)."""


DEFAULT_LIMITS = JsonLimits()


class JsonRejected(ValueError):
    """Why a document was refused (a ValueError, so callers that already catch bad JSON keep working)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _constant(name: str) -> Any:
    raise JsonRejected(f"{name} is not a JSON number (non-finite values are not accepted)")


def loads(data: bytes | str, limits: JsonLimits = DEFAULT_LIMITS) -> Any:
    """The document in ``data``, or JsonRejected (malformed, invalid UTF-8, over a limit)."""
    doc = _fast(data, limits)
    return doc if doc is not _SLOW else stdlib_loads(data, limits)


_SLOW: Any = object()
_DIGITS = bytes(0x30 if 0x30 <= i <= 0x39 else 0x20 for i in range(256))
"""Every digit as ``0``, every other byte as a space: a run of digits is then found by ``in`` (C, ~1 GB/s)."""
_INT64_DIGITS = 19
"""Digits from which an integer may not fit in 64 bits (orjson's limit; 2**63 has 19)."""
_LITERAL_MAX = 4 + 3 * (_INT64_DIGITS - 1)
"""The longest number literal with no run of ``_INT64_DIGITS`` digits: sign, point, exponent mark and its
sign around three runs (integer, fraction, exponent)."""
_NUMERIC = bytes(0x30 if chr(i) in "0123456789.eE+-" else 0x20 for i in range(256))


def _fast(data: bytes | str, limits: JsonLimits) -> Any:
    """The document by orjson, or ``_SLOW`` where only the stdlib path answers as kvgate always has."""
    try:
        doc = orjson.loads(data)
    except orjson.JSONDecodeError:  # refused (or past orjson's 1024 levels): the stdlib path says why
        return _SLOW
    raw = data.encode() if isinstance(data, str) else data  # valid UTF-8: orjson took it
    digits = raw.translate(_DIGITS)
    if b"0" * _INT64_DIGITS in digits:
        return _SLOW  # maybe a big integer, which orjson turns into a float (or a long digit run in a string)
    if limits.max_number_chars < _LITERAL_MAX and b"0" * (limits.max_number_chars + 1) in raw.translate(_NUMERIC):
        return _SLOW  # maybe a literal over the limit
    if not _within_depth(doc, limits.max_depth):
        return _SLOW
    return doc


def _within_depth(doc: Any, max_depth: int) -> bool:
    """Containers only: orjson's strings are valid Unicode and it has no NaN, so ``check``'s string and
    float checks have nothing to find."""
    if type(doc) is not dict and type(doc) is not list:
        return True
    stack: list[tuple[Any, int]] = [(doc, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > max_depth:
            return False
        for v in node.values() if type(node) is dict else node:
            if type(v) is dict or type(v) is list:
                stack.append((v, depth + 1))
    return True


def stdlib_loads(data: bytes | str, limits: JsonLimits = DEFAULT_LIMITS) -> Any:
    """``loads`` by the stdlib parser with kvgate's hooks: the reference every answer is kept equal to."""
    max_num = limits.max_number_chars

    def parse_int(s: str) -> int:
        if len(s) > max_num:
            raise JsonRejected(f"a number of {len(s)} characters exceeds the limit of {max_num}")
        return int(s)

    def parse_float(s: str) -> float:
        if len(s) > max_num:
            raise JsonRejected(f"a number of {len(s)} characters exceeds the limit of {max_num}")
        v = float(s)
        if v in (float("inf"), float("-inf")):  # 1e999 parses to inf
            raise JsonRejected(f"number {s[:40]} is out of range")
        return v

    try:
        if isinstance(data, bytes | bytearray):
            data = bytes(data).decode("utf-8")  # strict: invalid UTF-8 is refused, not replaced
        doc = json.loads(data, parse_int=parse_int, parse_float=parse_float, parse_constant=_constant)
    except JsonRejected:
        raise
    except RecursionError:
        raise JsonRejected(f"nesting exceeds the limit of {limits.max_depth}") from None
    except UnicodeDecodeError as exc:
        raise JsonRejected(f"body is not valid UTF-8 ({exc.reason} at byte {exc.start})") from None
    except ValueError as exc:
        raise JsonRejected(f"not valid JSON: {str(exc)[:200]}") from None
    check(doc, limits)
    return doc


def check(doc: Any, limits: JsonLimits = DEFAULT_LIMITS) -> None:
    """JsonRejected if ``doc`` (already parsed) nests deeper than allowed or holds a lone surrogate.
    Iterative: a deep document must not overflow the checker's own stack."""
    stack: list[tuple[Any, int]] = [(doc, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, str):
            _text(node)
        elif isinstance(node, dict | list):
            if depth > limits.max_depth:
                raise JsonRejected(f"nesting exceeds the limit of {limits.max_depth}")
            if isinstance(node, dict):
                for k, v in node.items():
                    _text(k)
                    stack.append((v, depth + 1))
            else:
                stack.extend((v, depth + 1) for v in node)
        elif isinstance(node, float) and node != node:  # NaN from a caller that built the document itself
            raise JsonRejected("NaN is not a JSON number")


def _text(s: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise JsonRejected(f"string holds a lone surrogate (\\u{ord(s[exc.start]):04x}) at character "
                           f"{exc.start}; text must be valid Unicode") from None


def try_loads(text: str, limits: JsonLimits = DEFAULT_LIMITS) -> tuple[bool, Any]:
    """(True, document) or (False, None): for JSON kvgate reads out of a request field (tool-call
    arguments), where a bad value is the client's text to pass on, not an error."""
    try:
        return True, loads(text, limits)
    except JsonRejected:
        return False, None


def dumps(doc: Any) -> bytes:
    """``doc`` (a parsed document, maybe changed) as JSON bytes: by orjson (a twentieth of ``json.dumps``'s
    CPU on a long chat body), or by the stdlib for what orjson cannot write (an integer past 64 bits,
    which ``loads`` accepts)."""
    try:
        return orjson.dumps(doc)
    except TypeError:
        return json.dumps(doc).encode()
