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
    return [((c.get("function") or {}).get("name"), _args(c)) for c in _tool_calls(m)]


def _tool_calls(m: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    calls = m.get("tool_calls")
    return [c for c in calls if isinstance(c, Mapping)] if isinstance(calls, list) else []


def _ids(m: Mapping[str, Any]) -> list[Any]:
    return [c.get("id") for c in _tool_calls(m)]


def _text(m: Mapping[str, Any]) -> str:
    """The text the template renders: content parts joined, null as empty."""
    c = m.get("content")
    if isinstance(c, list):
        return "".join(p["text"] for p in c if isinstance(p, Mapping) and p.get("type", "text") == "text"
                       and isinstance(p.get("text"), str))
    return c if isinstance(c, str) else ""


def _content(m: Mapping[str, Any]) -> str:
    """What the content says: vLLM answers a tool call with content "" (the simulator with null) and the
    hermes parser with the whitespace the model wrote before ``<tool_call>``; clients echo any of these."""
    t = _text(m)
    return t if t.strip() else ""


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
    ex_args = [(c.get("function") or {}).get("arguments") for c in _tool_calls(exact)]
    cl_args = [(c.get("function") or {}).get("arguments") for c in _tool_calls(client)]
    if ex_args != cl_args:
        diffs.append("tool_calls.arguments")
    if _text(client) != _text(exact):
        diffs.append("content")  # blank content dropped or added, or sent as parts
    return diffs


def find_exact(stored: Sequence[Mapping[str, Any]], client: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The stored reply (as the worker generated it) this client message is a copy of, never a guess.

    With tool calls: the stored replies whose calls mean the same (names, parsed arguments), and of those
    the ones with the client's tool-call ids. Ids alone do not tell (vLLM's Kimi-K2 ids are
    ``functions.<name>:<n>``, and clients renumber ids), meaning alone does not either when an agent
    repeats a call; so the ids decide when they match, the meaning when they match nothing. Without tool
    calls: by content, or by reasoning when the reply had no content (vLLM with a reasoning parser answers
    a reply cut short in its thought with content null). Whatever matches must be one reply, or copies
    of one — two replies that read the same ("Done.") but thought differently cannot be told apart, and
    guessing would put one turn's reasoning into another."""
    calls = _calls(client)
    if calls:
        same = [m for m in stored if _calls(m) == calls]
        ids = _ids(client)
        by_id = [m for m in same if any(ids) and _ids(m) == ids]
        return _one(by_id) if by_id else _one(same)
    text = _content(client)
    thought, _ = reasoning_of(client)
    if not text and thought is None:
        return None  # an empty message says nothing about which reply it is
    return _one([m for m in stored if not _tool_calls(m) and _content(m) == text
                 and (thought is None or reasoning_of(m)[0] == thought)])


def _one(candidates: Sequence[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    """The candidate, if all candidates are the same reply (a conversation may hold copies of one)."""
    if not candidates or any(_reply_form(c) != _reply_form(candidates[0]) for c in candidates[1:]):
        return None
    return candidates[-1]


def _reply_form(m: Mapping[str, Any]) -> tuple[Any, ...]:
    calls = [((c.get("function") or {}).get("name"), (c.get("function") or {}).get("arguments"))
             for c in _tool_calls(m)]
    return _text(m), reasoning_of(m)[0], calls


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
        # The exact calls with the client's ids: its tool results name those (and some templates render them).
        msg["tool_calls"] = [{**c, "id": cl.get("id", c.get("id"))}
                             for c, cl in zip(_tool_calls(exact), _tool_calls(client), strict=False)]
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
