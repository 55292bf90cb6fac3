"""Input items as chat messages, so the prompt the worker's chat template renders is the one kvgate
hashes: a ``reasoning`` item and the assistant ``message``/``function_call`` items after it are one
assistant message (``reasoning``, ``content``, ``tool_calls`` with ``id`` = ``call_id``) — the shape the
engine produced — and a ``function_call_output`` is a ``tool`` message. Items the chat pipeline cannot
carry are refused (400), never dropped: a dropped item would change the prompt the model sees without the
client knowing. Pure: the stored conversation's call ids come in as an argument."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from kvgate.fronts.responses.translate import bad, text_or


def _text_of(parts: Any, allowed: frozenset[str], where: str) -> str:
    """The text of a content array (parts joined by a newline, as vLLM joins text parts)."""
    if isinstance(parts, str):
        return parts
    if not isinstance(parts, list):
        raise bad(f"'{where}' must be a string or an array of content parts.", where)
    texts = []
    for j, p in enumerate(parts):
        kind = text_or(p.get("type"), "") if isinstance(p, dict) else ""
        if kind not in allowed:
            raise bad(f"'{where}[{j}]': content part type {kind[:80]!r} is not supported here by kvgate "
                      f"(accepted: {', '.join(sorted(allowed))}).", f"{where}[{j}].type", "unsupported_content")
        assert isinstance(p, dict)
        text = p.get("refusal") if kind == "refusal" else p.get("text")
        if not isinstance(text, str):
            raise bad(f"'{where}[{j}]' needs a string text.", f"{where}[{j}]")
        texts.append(text)
    return "\n".join(texts)


_USER_PARTS = frozenset({"input_text"})
_ASSISTANT_PARTS = frozenset({"output_text", "input_text", "refusal"})
_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}


def _reasoning_text(it: Mapping[str, Any], where: str) -> str:
    if it.get("encrypted_content"):
        # Opaque state of another provider's model: no engine kvgate serves can decrypt it, and replaying
        # the item without it would change the prompt the model continues from. vLLM's own /v1/responses
        # refuses it the same way (responses_utils: "Encrypted content is not supported").
        raise bad(f"'{where}.encrypted_content': encrypted reasoning cannot be read by the models kvgate serves; "
                  "resend the reasoning as 'content' (reasoning_text), as kvgate returns it, or use "
                  "previous_response_id.", f"{where}.encrypted_content", "unsupported_content")
    content = it.get("content")
    if content:
        return _parts(content, "reasoning_text", f"{where}.content")
    return _parts(it.get("summary") or [], "summary_text", f"{where}.summary")


def _parts(parts: Any, kind: str, where: str) -> str:
    if not isinstance(parts, list):
        raise bad(f"'{where}' must be an array.", where)
    out = []
    for j, p in enumerate(parts):
        if not isinstance(p, dict) or p.get("type") != kind or not isinstance(p.get("text"), str):
            raise bad(f"'{where}[{j}]' must be {{\"type\": \"{kind}\", \"text\": <string>}}.", f"{where}[{j}]")
        out.append(p["text"])
    return "\n".join(out)


class _Messages:
    """Chat messages being built from items: consecutive assistant items join one assistant message."""

    def __init__(self, known_calls: Iterable[str]) -> None:
        self.out: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None
        self.calls = set(known_calls)

    def assistant(self, *, reasoning: str | None = None, content: str | None = None,
                  call: dict[str, Any] | None = None) -> None:
        m = self.open
        # A new assistant message starts where the open one could not take this part in order.
        if m is None or (reasoning is not None and (m.get("reasoning") or m["content"] or m.get("tool_calls"))) \
                or (content is not None and m.get("tool_calls")):
            m = self.open = {"role": "assistant", "content": ""}
            self.out.append(m)
        if reasoning is not None:
            m["reasoning"] = reasoning
        if content is not None:
            m["content"] = m["content"] + content
        if call is not None:
            m.setdefault("tool_calls", []).append(call)

    def other(self, msg: dict[str, Any]) -> None:
        self.open = None
        self.out.append(msg)


def to_messages(items: list[dict[str, Any]], known_calls: Iterable[str] = ()) -> list[dict[str, Any]]:
    """The chat messages of ``items``. ``known_calls``: call ids of function calls in the stored history
    (a ``function_call_output`` must answer one of them or a ``function_call`` before it)."""
    ms = _Messages(known_calls)
    for i, it in enumerate(items):
        where = f"input[{i}]"
        kind = it.get("type", "message" if "role" in it else None)
        if kind == "message":
            role = _ROLES.get(text_or(it.get("role"), ""))
            if role is None:
                raise bad(f"'{where}.role' must be one of user, assistant, system, developer.", f"{where}.role")
            if role == "assistant":
                ms.assistant(content=_text_of(it.get("content"), _ASSISTANT_PARTS, f"{where}.content"))
            else:
                ms.other({"role": role, "content": _text_of(it.get("content"), _USER_PARTS, f"{where}.content")})
        elif kind == "reasoning":
            ms.assistant(reasoning=_reasoning_text(it, where))
        elif kind == "function_call":
            call_id, name, args = it.get("call_id"), it.get("name"), it.get("arguments")
            if not (isinstance(call_id, str) and call_id and isinstance(name, str) and name
                    and isinstance(args, str)):
                raise bad(f"'{where}': a function_call needs string call_id, name and arguments.", where)
            ms.calls.add(call_id)
            ms.assistant(call={"id": call_id, "type": "function", "function": {"name": name, "arguments": args}})
        elif kind == "function_call_output":
            call_id = it.get("call_id")
            if not isinstance(call_id, str) or call_id not in ms.calls:
                raise bad(f"'{where}.call_id': no function_call with call_id {str(call_id)[:80]!r} in the input or "
                          "the stored conversation.", f"{where}.call_id", "unknown_call_id")
            ms.other({"role": "tool", "tool_call_id": call_id,
                      "content": _text_of(it.get("output"), _USER_PARTS | {"output_text"}, f"{where}.output")})
        else:
            raise bad(f"'{where}.type': input item type {str(kind)[:80]!r} is not supported by kvgate (accepted: "
                      "message, reasoning, function_call, function_call_output).", f"{where}.type",
                      "unsupported_item")
    return ms.out
