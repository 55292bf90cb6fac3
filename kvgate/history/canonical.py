"""Turn-scoped reasoning: the conversation history as kvgate sends it.

Inside the open turn (the last real user message and the assistant/tool chain after it) the model's
output goes back exactly as it was generated. Completed turns (everything before that user message)
are rewritten into a canonical form: their reasoning kept, dropped or truncated as the model protocol
and the policy say. Stateless clients that echo history back often re-serialise the assistant's
messages (tool-call arguments re-dumped, reasoning moved to another field or omitted); kvgate recognises
its own messages and restores the exact form — never when the content really changed. The same
inputs always give the same canonical history, so it stays byte-stable turn after turn. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvgate import safejson
from kvgate.history.protocols import ModelProtocol

Message = dict[str, Any]
REASONING_FIELDS = ("reasoning", "reasoning_content")


def reasoning_of(m: Mapping[str, Any]) -> tuple[str | None, str | None]:
    """(the reasoning text, the field it was found in)."""
    for f in REASONING_FIELDS:
        v = m.get(f)
        if isinstance(v, str) and v:
            return v, f
    return None, None


def is_real_user(m: Mapping[str, Any]) -> bool:
    """A user message that starts a turn (not a tool result wrapped as user content)."""
    if m.get("role") != "user":
        return False
    c = m.get("content")
    return not (isinstance(c, str) and c.startswith("<tool_response>") and c.endswith("</tool_response>"))


def open_turn_start(messages: Sequence[Mapping[str, Any]]) -> int:
    """Index of the user message that opens the current turn (0 if there is none)."""
    for i in range(len(messages) - 1, -1, -1):
        if is_real_user(messages[i]):
            return i
    return 0


def _args(call: Mapping[str, Any]) -> Any:
    fn = call.get("function") or {}
    a = fn.get("arguments")
    if isinstance(a, str):
        ok, doc = safejson.try_loads(a) if a.strip() else (True, {})
        return doc if ok else a
    return a if a is not None else {}


def _calls(m: Mapping[str, Any]) -> list[tuple[Any, Any]]:
    return [((c.get("function") or {}).get("name"), _args(c)) for c in m.get("tool_calls") or []]


def _content(m: Mapping[str, Any]) -> str:
    c = m.get("content")
    return c if isinstance(c, str) else ""


@dataclass(frozen=True, slots=True)
class Restoration:
    index: int
    field: str
    """What the client changed without changing the meaning: ``tool_calls.arguments``,
    ``reasoning_omitted``, ``reasoning_field:<name>``."""


def reserialization(client: Mapping[str, Any], exact: Mapping[str, Any]) -> list[str] | None:
    """The fields a client re-serialised, or None if the client really changed the message."""
    if client.get("role") != "assistant" or _content(client) != _content(exact):
        return None
    if _calls(client) != _calls(exact):
        return None
    r_client, f_client = reasoning_of(client)
    r_exact, _ = reasoning_of(exact)
    diffs = []
    if r_client is None and r_exact is not None:
        diffs.append("reasoning_omitted")
    elif r_client is not None and r_client != r_exact:
        return None  # the reasoning itself was edited: the client's choice, kept
    elif r_client is not None and f_client != "reasoning" and f_client is not None:
        diffs.append(f"reasoning_field:{f_client}")
    ex_args = [(c.get("function") or {}).get("arguments") for c in exact.get("tool_calls") or []]
    cl_args = [(c.get("function") or {}).get("arguments") for c in client.get("tool_calls") or []]
    if ex_args != cl_args:
        diffs.append("tool_calls.arguments")
    return diffs


def find_exact(stored: Sequence[Mapping[str, Any]], client: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The stored reply (as the worker generated it) this client message is a copy of: by tool-call ids
    (unique per generation), or by content when exactly one stored reply has that content — two replies
    that read the same ("Done.") cannot be told apart, and guessing would put one turn's reasoning into
    another."""
    calls = client.get("tool_calls") or []
    ids = [c.get("id") for c in calls if isinstance(c, dict) and c.get("id")]
    if ids:
        return next((m for m in reversed(stored) if [c.get("id") for c in m.get("tool_calls") or []] == ids), None)
    text = _content(client)
    same = [m for m in stored if not m.get("tool_calls") and text and _content(m) == text]
    return same[0] if len(same) == 1 else None


@dataclass
class Canonical:
    messages: list[Message]
    restored: list[Restoration] = field(default_factory=list)
    reasoning_changed: list[int] = field(default_factory=list)
    """Completed-turn assistant messages whose reasoning the policy dropped or truncated."""
    open_turn: int = 0


def canonicalize(messages: Sequence[Mapping[str, Any]], protocol: ModelProtocol, exact: Sequence[Mapping[str, Any]],
                 truncate: Callable[[str, int], str]) -> Canonical:
    """``exact``: the conversation's replies as the worker generated them (its record's)."""
    out: list[Message] = []
    restored: list[Restoration] = []
    changed: list[int] = []
    start = open_turn_start(messages)
    for i, m in enumerate(messages):
        msg: Message = dict(m)
        if msg.get("role") == "assistant":
            found = find_exact(exact, msg)
            diffs = reserialization(msg, found) if found is not None else None
            if found is not None and diffs is not None:
                restored += [Restoration(i, d) for d in diffs]
                msg = _exact_form(found, msg)
            msg = _reasoning_to(msg, protocol.reasoning_in)
            if i < start:
                msg, did = _apply_policy(msg, protocol, truncate)
                if did:
                    changed.append(i)
        out.append(msg)
    return Canonical(out, restored, changed, start)


def _exact_form(exact: Mapping[str, Any], client: Mapping[str, Any]) -> Message:
    msg: Message = {k: v for k, v in client.items() if k not in REASONING_FIELDS and k != "tool_calls"}
    msg["content"] = exact.get("content")
    r, _ = reasoning_of(exact)
    if r is not None:
        msg["reasoning"] = r
    if exact.get("tool_calls"):
        msg["tool_calls"] = [dict(c) for c in exact["tool_calls"]]
    return msg


def _reasoning_to(msg: Message, field_in: str) -> Message:
    r, f = reasoning_of(msg)
    if r is None or f == field_in:
        return msg
    out = {k: v for k, v in msg.items() if k not in REASONING_FIELDS}
    out[field_in] = r
    return out


def _apply_policy(msg: Message, protocol: ModelProtocol, truncate: Callable[[str, int], str]) -> tuple[Message, bool]:
    r, f = reasoning_of(msg)
    if r is None or f is None or protocol.policy.mode == "keep":
        return msg, False
    if protocol.reasoning_required_with_tools and msg.get("tool_calls"):
        return msg, False  # DeepSeek: a turn that used tools must send its reasoning back
    if protocol.policy.mode == "drop":
        return {k: v for k, v in msg.items() if k not in REASONING_FIELDS}, True
    cut = truncate(r, protocol.policy.tokens)
    if cut == r:
        return msg, False
    return {**msg, f: cut}, True
