"""Which conversation a request belongs to.

Order: a configured header (``X-Conversation-Id``, ``X-Session-Id``, ...), then the body's
``conversation_id``, then a key derived from the tenant and the first system and user messages —
stateless agent clients resend those every turn, so the key is stable across a conversation.
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


def resolve(headers: Mapping[str, str], body: Mapping[str, Any], header_names: Sequence[str],
            tenant_header: str, tenant: str | None = None) -> Identity:
    """``tenant``: the authenticated caller's (auth on); None takes the tenant header's (auth off)."""
    if tenant is None:
        tenant = headers.get(tenant_header, "") or ""
    if tenant:
        _check(tenant, "the tenant id", tenant_header)
    for name in header_names:
        v = headers.get(name)
        if v:
            return Identity(_scoped(tenant, _check(v, "the conversation id", name)), f"header:{name}", tenant)
    cid = body.get("conversation_id")
    if isinstance(cid, str) and cid:
        return Identity(_scoped(tenant, _check(cid, "conversation_id", "conversation_id")), "body", tenant)
    msgs = body.get("messages")
    key = derive_key(tenant, msgs if isinstance(msgs, list) else None, body.get("prompt"))
    return Identity(ConversationId(key), "derived", tenant)


def _scoped(tenant: str, cid: str) -> ConversationId:
    # Two tenants may pick the same id; they must never share a conversation.
    return ConversationId(f"{tenant}/{cid}" if tenant else cid)
