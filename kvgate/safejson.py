"""JSON from untrusted clients, parsed so that no document can crash or stall what reads it.

Python's ``json`` accepts what later code cannot handle: ``NaN``/``Infinity`` (poison for arithmetic and
for the policy's coefficients), lone surrogates such as ``"\\ud800"`` (valid JSON escapes that no UTF-8
encoder, tokenizer or HTTP client will take), integers of thousands of digits (``int()`` refuses past
4,300 and arithmetic on them is slow), and nesting deep enough that recursive consumers (templates,
validators, ``json.dumps``) overflow the stack. ``loads`` refuses all of them up front with
``JsonRejected``, which every entry point turns into an OpenAI-style 400; nothing past it has to care.

Pure: no I/O, no state; limits come in as a ``JsonLimits``.
"""

from __future__ import annotations

import json
from typing import Any

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
