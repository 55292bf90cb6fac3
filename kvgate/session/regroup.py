"""Finding a keyless client's conversation again after it compacted or rewound its context.

A client that sends no conversation key gets a key derived from its first system and user messages
(``gateway/identity.py``). That key breaks the moment the agent compacts (the old turns become a summary,
so the first user message changes) — and with it the conversation's record: its exact replies, its chain,
its home worker. What survives a compaction is the messages the agent kept verbatim (Codex keeps the user
messages, most harnesses the last few turns); what survives a rewind is the prefix. So each recorded turn
files digests of its newest messages under its conversation, and a request whose derived key names no
conversation looks its messages up: the conversation most of them were filed under, if one leads, is its
own.

System and developer messages are left out (every conversation of one agent shares them) and so are short
ones ("ok", "continue"): they would vote for whichever conversation filed them last. Digests are of what a
message says, not its bytes: tool-call arguments parsed, reasoning ignored, so a client that re-serialises
its history still finds it. Pure: the index itself is ``kvstore/grouping.py``.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from kvgate import safejson
from kvgate.router.types import ConversationId

MIN_CHARS = 24
"""Messages with less text than this say nothing about which conversation they belong to."""

LOOKUP_HEAD = 8
LOOKUP_TAIL = 24
"""A request looks up the digests of its first and its last informative messages (a compaction keeps
the first user messages or the last turns; the middle adds lookups, not evidence)."""

INDEX_TAIL = 8
"""A recorded turn files its reply and its request's last messages: the earlier ones were filed by the
turns before it, so the work per turn follows what is new, not the history."""

ALIAS = "k:"
"""The derived key itself, filed under the conversation it was regrouped into: the next request after a
compaction (same new first messages, so the same derived key) finds it in one lookup."""


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, Mapping) and isinstance(p.get("text"), str))
    return ""


def _arguments(raw: Any) -> Any:
    # Clients re-dump arguments (other key order, other spacing): the digest is of what they mean. Parsed
    # within kvgate's JSON limits: hostile arguments ("[[[[...") are the client's text, digested as it is.
    if isinstance(raw, str):
        ok, doc = safejson.try_loads(raw)
        return doc if ok else raw
    return raw


def message_digest(m: Mapping[str, Any]) -> str | None:
    """What a message says, as a digest; None for a message that cannot tell conversations apart."""
    role = m.get("role")
    if role in ("system", "developer") or not isinstance(role, str):
        return None
    text = _text(m.get("content"))
    calls = []
    for tc in m.get("tool_calls") or ():
        fn = tc.get("function") if isinstance(tc, Mapping) else None
        if isinstance(fn, Mapping):
            calls.append([fn.get("name"), _arguments(fn.get("arguments"))])
    if len(text) + sum(len(str(c)) for c in calls) < MIN_CHARS:
        return None
    try:
        data = json.dumps([role, text, calls], sort_keys=True, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError):
        return None
    return hashlib.blake2b(data.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


def _informative(messages: Sequence[Mapping[str, Any]]) -> list[str]:
    out = []
    for m in messages:
        d = message_digest(m) if isinstance(m, Mapping) else None
        if d is not None:
            out.append(d)
    return out


def lookup_digests(messages: Sequence[Mapping[str, Any]], derived_key: str) -> list[str]:
    """What a request whose derived key names no conversation looks up: its alias first."""
    found = _informative(messages)
    picked = found if len(found) <= LOOKUP_HEAD + LOOKUP_TAIL else found[:LOOKUP_HEAD] + found[-LOOKUP_TAIL:]
    return [ALIAS + derived_key, *dict.fromkeys(picked)]


def index_digests(messages: Sequence[Mapping[str, Any]], reply: Mapping[str, Any] | None,
                  derived_key: str | None) -> list[str]:
    """What a recorded turn files under its conversation (``derived_key``: the request's own, when the
    conversation was found by regrouping, so later requests with that key come straight to it)."""
    tail = [*messages[-INDEX_TAIL:], *([reply] if reply is not None else [])]
    out = list(dict.fromkeys(_informative(tail)))
    return [ALIAS + derived_key, *out] if derived_key is not None else out


def vote(found: Sequence[ConversationId | None]) -> ConversationId | None:
    """The request's conversation from what its lookups found (``found[0]``: the alias), or None.

    The alias decides alone. Otherwise the conversation most messages were filed under, when it leads
    outright: a tie means the messages are shared between conversations and say nothing."""
    if found and found[0] is not None:
        return found[0]
    votes = Counter(c for c in found[1:] if c is not None)
    if not votes:
        return None
    (best, n), *rest = votes.most_common(2)
    if rest and rest[0][1] == n:
        return None
    return best
