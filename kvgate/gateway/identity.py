"""Which conversation a request belongs to.

Order (docs/protocols.md):
1. kvgate's configured headers (``conversation_headers``, ``X-Conversation-Id`` by default);
2. the agent harnesses' own session headers, when ``harness_session_keys`` is on: Claude Code's
   ``x-claude-code-session-id``, Codex's ``session-id`` (legacy ``session_id``), OpenCode's
   ``x-session-affinity``, then ``x-session-id`` (OpenCode, Dynamo, vllm-router);
3. the body: kvgate's ``conversation_id``, then ``session_id`` (vLLM, OpenRouter), ``prompt_cache_key``
   (OpenAI), ``metadata.user_id`` (Anthropic);
4. (``previous_response_id``, resolved by the caller through the store);
5. a key derived from the tenant and the first system and user messages — stateless agent clients resend
   those every turn, so the key is stable across a conversation.

A sub-agent is a conversation of its own, linked to its parent: Claude Code's ``x-claude-code-agent-id``
names it inside its session (``x-claude-code-parent-agent-id`` its parent agent, else the session's main
agent); ``x-parent-session-id`` names the parent of any other session header's conversation.

kvgate's own keys are checked strictly (a bad one is the client's 400). The harnesses' and the bodies'
keys were not written for kvgate: a value outside kvgate's id alphabet is hashed into one rather than
refused, so a client that works against the engine directly keeps working through kvgate.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvgate.router.types import ConversationId


@dataclass(frozen=True, slots=True)
class Identity:
    conversation_id: ConversationId
    source: str
    tenant: str
    parent: ConversationId | None = None
    """The conversation this one was spawned from (a sub-agent's parent), tenant-scoped like the id."""
    alias: ConversationId | None = None
    """Regrouped: the derived key the request came with (its first messages changed by a compaction)."""


@dataclass(frozen=True, slots=True)
class SessionHeader:
    """A harness's session header and the headers that place a sub-agent relative to it."""

    name: str
    agent: str | None = None
    """Names a sub-agent inside the session: the conversation is ``<session>:agent:<agent>``."""
    parent_agent: str | None = None
    """The sub-agent's parent agent in the same session (absent: the session's main agent)."""
    parent_session: str | None = None
    """Names the parent session of this session (OpenCode's child sessions)."""


HARNESS_HEADERS: tuple[SessionHeader, ...] = (
    SessionHeader("x-claude-code-session-id", agent="x-claude-code-agent-id",
                  parent_agent="x-claude-code-parent-agent-id"),
    SessionHeader("session-id", parent_session="x-parent-session-id"),
    SessionHeader("session_id", parent_session="x-parent-session-id"),
    SessionHeader("x-session-affinity", parent_session="x-parent-session-id"),
    SessionHeader("x-session-id", parent_session="x-parent-session-id"),
)
"""In precedence order, after kvgate's own ``conversation_headers``."""

BODY_KEYS: tuple[tuple[str, ...], ...] = (("session_id",), ("prompt_cache_key",), ("metadata", "user_id"))
"""Body fields that name a conversation, after kvgate's ``conversation_id``, in precedence order."""


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def derive_key(tenant: str, messages: Sequence[Mapping[str, Any]] | None, prompt: Any = None) -> str:
    first_system = first_user = ""
    for m in messages or ():
        role = m.get("role")
        if role in ("system", "developer") and not first_system:
            first_system = _text(m.get("content"))
        elif role == "user" and not first_user:
            first_user = _text(m.get("content"))
            break
    if messages is None and prompt is not None:
        # Completions: a prompt has no turns; its first 2 KiB stand in for system + first user text.
        first_user = (prompt if isinstance(prompt, str) else json.dumps(prompt))[:2048]
    h = hashlib.blake2b(json.dumps([tenant, first_system, first_user]).encode(), digest_size=12)
    return "d-" + h.hexdigest()


_ID = re.compile(r"^[A-Za-z0-9._:@+=-]{1,256}$")


class BadIdentity(ValueError):
    """A conversation or tenant id with characters kvgate does not accept."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def _check(value: str, what: str, param: str) -> str:
    # Ids travel back in response headers and scope each other ("tenant/id"): no "/", no control or
    # non-ASCII characters, so one client can neither break a header nor alias another tenant's id.
    if not _ID.match(value):
        raise BadIdentity(f"{what} must be 1-256 characters of A-Z a-z 0-9 . _ : @ + = -", param)
    return value


def _foreign(value: str) -> str:
    """A key kvgate did not define, made an id: kept when it already is one, else its digest."""
    if _ID.match(value):
        return value
    return "h-" + hashlib.blake2b(value.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


def _harness(headers: Mapping[str, str], tenant: str) -> Identity | None:
    for h in HARNESS_HEADERS:
        session = headers.get(h.name)
        if not session:
            continue
        sid = _foreign(session)
        agent = headers.get(h.agent) if h.agent else None
        if agent:
            parent_agent = headers.get(h.parent_agent) if h.parent_agent else None
            parent = f"{sid}:agent:{_foreign(parent_agent)}" if parent_agent else sid
            return Identity(_scoped(tenant, f"{sid}:agent:{_foreign(agent)}"), f"header:{h.name}", tenant,
                            _scoped(tenant, parent))
        up = headers.get(h.parent_session) if h.parent_session else None
        return Identity(_scoped(tenant, sid), f"header:{h.name}", tenant, _scoped(tenant, _foreign(up)) if up else None)
    return None


def _body_key(body: Mapping[str, Any], tenant: str) -> Identity | None:
    for path in BODY_KEYS:
        v: Any = body
        for part in path:
            v = v.get(part) if isinstance(v, Mapping) else None
        if isinstance(v, str) and v:
            return Identity(_scoped(tenant, _foreign(v)), "body:" + ".".join(path), tenant)
    return None


def resolve(headers: Mapping[str, str], body: Mapping[str, Any], header_names: Sequence[str],
            tenant_header: str, tenant: str | None = None, *, harness: bool = True) -> Identity:
    """``tenant``: the authenticated caller's (auth on); None takes the tenant header's (auth off).
    ``harness``: also read the agent harnesses' session headers and the bodies' session fields."""
    if tenant is None:
        tenant = headers.get(tenant_header, "") or ""
    if tenant:
        _check(tenant, "the tenant id", tenant_header)
    for name in header_names:
        v = headers.get(name)
        if v:
            up = headers.get("x-parent-session-id") if harness else None
            return Identity(_scoped(tenant, _check(v, "the conversation id", name)), f"header:{name}", tenant,
                            _scoped(tenant, _foreign(up)) if up else None)
    found = _harness(headers, tenant) if harness else None
    if found is not None:
        return found
    cid = body.get("conversation_id")
    if isinstance(cid, str) and cid:
        return Identity(_scoped(tenant, _check(cid, "conversation_id", "conversation_id")), "body", tenant)
    found = _body_key(body, tenant) if harness else None
    if found is not None:
        return found
    msgs = body.get("messages")
    key = derive_key(tenant, msgs if isinstance(msgs, list) else None, body.get("prompt"))
    return Identity(ConversationId(key), "derived", tenant)


def _scoped(tenant: str, cid: str) -> ConversationId:
    # Two tenants may pick the same id; they must never share a conversation.
    return ConversationId(f"{tenant}/{cid}" if tenant else cid)
