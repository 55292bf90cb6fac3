"""Scripted model output: deterministic reasoning, answer and tool calls, controlled per request.

A request may carry a ``sim`` object (an extra field the real engine would ignore)::

    {"reasoning_tokens": 64, "answer_tokens": 16, "tool_calls": 1 | [{"name": ..., "arguments": {...}}],
     "seed": 7, "reasoning_text": "...", "content_text": "..."}   (the texts replay a recorded output)

Without it: reasoning and answer of default lengths; one call of the first offered tool when the
conversation's last message is a real user message (an agent's first step), a plain answer after a
tool result. The text is written in the tiny model's own output format (Qwen3 ``<think>`` and Hermes
``<tool_call>``), so the next request's history renders to the very tokens the engine generated.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvgate.tokens.tinymodel import WORDS

DEFAULT_REASONING_TOKENS = 24
DEFAULT_ANSWER_TOKENS = 12


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str
    """The JSON argument string exactly as generated."""


@dataclass(frozen=True, slots=True)
class Script:
    reasoning: str
    content: str
    tool_calls: tuple[ToolCall, ...]

    def text(self, thinking: bool) -> str:
        """The generated text (without the end-of-turn token), as the template will re-render it."""
        out = f"<think>\n{self.reasoning}\n</think>\n\n" if thinking else ""
        out += self.content
        for i, call in enumerate(self.tool_calls):
            if i > 0 or self.content:
                out += "\n"
            out += f'<tool_call>\n{{"name": "{call.name}", "arguments": {call.arguments}}}\n</tool_call>'
        return out


class BadSimSpec(ValueError):
    """The request's ``sim`` object is malformed."""


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(max(0, n)))


def _int_field(spec: Mapping[str, Any], key: str, default: int) -> int:
    v = spec.get(key, default)
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise BadSimSpec(f"sim.{key} must be a non-negative integer")
    return v


def script_for(
    messages: Sequence[Mapping[str, Any]] | None,
    tools: Sequence[Mapping[str, Any]] | None,
    spec: Mapping[str, Any] | None,
    prompt_key: bytes,
    request_id: str,
) -> Script:
    spec = spec or {}
    if not isinstance(spec, Mapping):
        raise BadSimSpec("sim must be an object")
    seed = spec.get("seed")
    rng = random.Random(
        int.from_bytes(hashlib.blake2b(prompt_key + repr(seed).encode(), digest_size=8).digest(), "big")
    )
    reasoning = _words(rng, _int_field(spec, "reasoning_tokens", DEFAULT_REASONING_TOKENS))
    if "reasoning_text" in spec:  # replaying a recorded trajectory: the exact thought
        if not isinstance(spec["reasoning_text"], str):
            raise BadSimSpec("sim.reasoning_text must be a string")
        reasoning = spec["reasoning_text"]
    answer_n = _int_field(spec, "answer_tokens", DEFAULT_ANSWER_TOKENS)
    calls_spec = spec.get("tool_calls")
    calls: list[ToolCall] = []
    if calls_spec is None:
        last = messages[-1] if messages else None
        if tools and last is not None and last.get("role") == "user":
            calls_spec = 1
        else:
            calls_spec = 0
    if isinstance(calls_spec, bool) or not isinstance(calls_spec, int | list):
        raise BadSimSpec("sim.tool_calls must be an integer or a list of {name, arguments}")
    if isinstance(calls_spec, int):
        names = [str((t.get("function") or {}).get("name", "tool")) for t in (tools or [])] or ["tool"]
        for i in range(calls_spec):
            args = {"query": _words(rng, 3), "step": i}
            calls.append(ToolCall(f"chatcmpl-tool-{request_id[-12:]}{i}", names[i % len(names)],
                                  json.dumps(args)))
    else:
        for i, c in enumerate(calls_spec):
            if not isinstance(c, Mapping) or not isinstance(c.get("name"), str):
                raise BadSimSpec("each sim.tool_calls entry needs a string name")
            args_obj = c.get("arguments", {})
            args_text = args_obj if isinstance(args_obj, str) else json.dumps(args_obj)
            calls.append(ToolCall(f"chatcmpl-tool-{request_id[-12:]}{i}", c["name"], args_text))
    # An agent step that calls tools usually says little; keep the answer when asked explicitly.
    content = _words(rng, answer_n) if (not calls or "answer_tokens" in spec) else ""
    if "content_text" in spec:
        if not isinstance(spec["content_text"], str):
            raise BadSimSpec("sim.content_text must be a string")
        content = spec["content_text"]
    return Script(reasoning=reasoning, content=content, tool_calls=tuple(calls))
