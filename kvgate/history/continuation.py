"""Stateful continuation (``previous_response_id``): the client sends only what is new, kvgate holds the
rest. Pure: the stored history comes in as an argument."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvgate.history.canonical import Message, reserialization


class UnknownResponse(LookupError):
    """A stateful continuation names a response kvgate does not hold (expired, never seen, or another
    tenant's)."""


class HistoryConflict(ValueError):
    """A stateful continuation's history disagrees with the stored one at ``index``."""

    def __init__(self, index: int) -> None:
        super().__init__(f"history differs from the stored conversation at message {index}")
        self.index = index


def continue_from(stored: Sequence[Message], messages: list[Message]) -> list[Message]:
    """The full history of a stateful continuation: the stored history and reply, then the new messages.
    A client that resends history must resend the stored one (re-serialisations allowed); otherwise
    HistoryConflict names the first differing message."""
    resent = (bool(messages) and messages[0].get("role") in ("system", "developer")) or (
        len(messages) > len(stored) and any(m.get("role") == "assistant" for m in messages[: len(stored)]))
    if not resent:
        return [*stored, *messages]
    for i, (old, new) in enumerate(zip(stored, messages, strict=False)):
        if old == new:
            continue
        if old.get("role") == "assistant" and reserialization(new, old) is not None:
            continue
        if _text_equal(old, new):
            continue
        raise HistoryConflict(i)
    if len(messages) < len(stored):
        raise HistoryConflict(len(messages))
    return [*stored, *messages[len(stored):]]


def _text_equal(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Same role and text (content as a string or as text parts)."""
    def text(m: Mapping[str, Any]) -> str:
        c = m.get("content")
        if isinstance(c, list):
            return "\n".join(p.get("text", "") for p in c if isinstance(p, dict))
        return c or ""

    return a.get("role") == b.get("role") and text(a) == text(b) and a.get("tool_call_id") == b.get("tool_call_id")
