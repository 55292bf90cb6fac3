"""Validation of client request bodies: clear OpenAI-style errors naming the field, nothing else.

Only what kvgate itself relies on is checked; every other field passes through to the worker, which
validates the rest (its 4xx answers go back to the client with their status and message, in OpenAI's shape:
``send.worker_error``).
"""

from __future__ import annotations

from typing import Any

from kvgate.errors import BadRequest, UnprocessableEntity

KVGATE_FIELDS = ("conversation_id", "reasoning_policy", "previous_response_id")
"""Request fields that belong to kvgate and are removed before forwarding."""

MAX_TOKEN_ID = 2**31
"""Token ids in a completion prompt are below this (vLLM and SGLang take them as 32-bit signed)."""

_ROLES = {"system", "developer", "user", "assistant", "tool", "function"}


def _require(body: dict[str, Any], field: str) -> Any:
    if field not in body or body[field] is None:
        raise UnprocessableEntity(f"'{field}' is a required property", param=field, code="missing_required_field")
    return body[field]


def _type(ok: bool, field: str, expected: str) -> None:
    if not ok:
        raise BadRequest(f"'{field}' must be {expected}", param=field, code="invalid_type")


def _common(body: dict[str, Any]) -> None:
    model = _require(body, "model")
    _type(isinstance(model, str) and bool(model), "model", "a non-empty string")
    if "stream" in body and body["stream"] is not None:
        _type(isinstance(body["stream"], bool), "stream", "a boolean")
    for f in ("max_tokens", "max_completion_tokens"):
        if body.get(f) is not None:
            v = body[f]
            _type(isinstance(v, int) and not isinstance(v, bool) and v > 0, f, "a positive integer")
    so = body.get("stream_options")
    if so is not None:
        _type(isinstance(so, dict), "stream_options", "an object")
    cid = body.get("conversation_id")
    if cid is not None:
        _type(isinstance(cid, str) and bool(cid), "conversation_id", "a non-empty string")


def validate_chat(body: dict[str, Any]) -> None:
    _common(body)
    messages = _require(body, "messages")
    _type(isinstance(messages, list) and len(messages) > 0, "messages", "a non-empty array")
    for i, m in enumerate(messages):
        _type(isinstance(m, dict), f"messages[{i}]", "an object")
        role = m.get("role")
        if role is None:
            raise UnprocessableEntity(f"'messages[{i}].role' is a required property", param=f"messages[{i}].role",
                                      code="missing_required_field")
        _type(isinstance(role, str) and role in _ROLES, f"messages[{i}].role", f"one of {sorted(_ROLES)}")
        content = m.get("content")
        _type(content is None or isinstance(content, str | list), f"messages[{i}].content",
              "a string or an array of content parts")
        if isinstance(content, list):
            for j, part in enumerate(content):
                _type(isinstance(part, dict) and (part.get("type") != "text" or isinstance(part.get("text"), str)),
                      f"messages[{i}].content[{j}]", "a content part object (text parts need a string text)")
        calls = m.get("tool_calls")
        if calls is not None:
            _type(isinstance(calls, list), f"messages[{i}].tool_calls", "an array")
            for j, c in enumerate(calls):
                fn = c.get("function") if isinstance(c, dict) else None
                _type(isinstance(fn, dict) and isinstance(fn.get("name"), str)
                      and (fn.get("arguments") is None or isinstance(fn.get("arguments"), str | dict)),
                      f"messages[{i}].tool_calls[{j}]",
                      "an object with function.name (string) and function.arguments (string or object)")
        for f in ("reasoning", "reasoning_content"):
            if m.get(f) is not None:
                _type(isinstance(m[f], str), f"messages[{i}].{f}", "a string")
    if body.get("tools") is not None:
        _type(isinstance(body["tools"], list), "tools", "an array")
    if body.get("previous_response_id") is not None:
        _type(isinstance(body["previous_response_id"], str) and bool(body["previous_response_id"]),
              "previous_response_id", "a non-empty string")
    if body.get("reasoning_policy") is not None:
        _type(isinstance(body["reasoning_policy"], str), "reasoning_policy", "a string (keep, drop, truncate:N)")


def validate_completion(body: dict[str, Any]) -> None:
    _common(body)
    prompt = _require(body, "prompt")
    ok = isinstance(prompt, str) or (
        isinstance(prompt, list) and len(prompt) > 0
        and (all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
             or all(isinstance(t, str) for t in prompt))
    )
    _type(ok, "prompt", "a string, an array of strings or an array of token ids")
    if isinstance(prompt, list) and isinstance(prompt[0], int) and not all(0 <= t < MAX_TOKEN_ID for t in prompt):
        # kvgate holds token ids as unsigned 32-bit (array "I"); engines' vocabularies are far smaller.
        bad = next(i for i, t in enumerate(prompt) if not 0 <= t < MAX_TOKEN_ID)
        raise BadRequest(f"'prompt[{bad}]' must be a token id between 0 and {MAX_TOKEN_ID - 1}",
                         param=f"prompt[{bad}]", code="invalid_value")
