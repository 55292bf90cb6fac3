"""How long a request asks for its conversation's KV to be kept, read from its protocol's markers. Pure.

- Anthropic Messages: ``cache_control: {"type": "ephemeral", "ttl": "5m" | "1h"}`` at the top level or on a
  system, message content (a tool_result's content too) or tool block. The longest marker wins: Anthropic
  keeps each marked prefix for its own ttl, and the conversation's KV holds all of them.
- OpenAI (Chat Completions, Responses): ``prompt_cache_retention: "24h"`` asks for a day; ``"in_memory"``
  (OpenAI's default) for nothing beyond what the engine keeps anyway.

The session controller caps the figure (``ControllerParams.max_retain_s``) and, on an answer, reserves the
conversation's KV on its home worker for that long, within the tenant's parked-KV budget (docs/tiering.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

EPHEMERAL_S = 300.0
"""An ``ephemeral`` marker without a ttl (or with one Anthropic does not define): Anthropic's 5 minutes."""

TTLS = {"5m": 300.0, "1h": 3600.0}

EXTENDED_S = 86400.0
"""``prompt_cache_retention: "24h"``."""


def cache_control_s(body: Mapping[str, Any]) -> float | None:
    """The longest ``cache_control`` ttl of a Messages request in seconds, None when nothing is marked.
    Runs on the client's body after the translation accepted it, so the shape is known; anything else
    is skipped, not refused (the translation decides what is refused)."""
    best: float | None = None

    def mark(block: Any) -> None:
        nonlocal best
        cc = block.get("cache_control") if isinstance(block, dict) else None
        if not isinstance(cc, dict) or cc.get("type") != "ephemeral":
            return
        ttl = cc.get("ttl")
        s = TTLS.get(ttl, EPHEMERAL_S) if isinstance(ttl, str) else EPHEMERAL_S
        best = s if best is None else max(best, s)

    mark(body)
    for key in ("system", "tools"):
        blocks = body.get(key)
        if isinstance(blocks, list):
            for b in blocks:
                mark(b)
    msgs = body.get("messages")
    for m in msgs if isinstance(msgs, list) else ():
        content = m.get("content") if isinstance(m, dict) else None
        for b in content if isinstance(content, list) else ():
            mark(b)
            inner = b.get("content") if isinstance(b, dict) and b.get("type") == "tool_result" else None
            for part in inner if isinstance(inner, list) else ():
                mark(part)
    return best


def prompt_cache_retention_s(value: Any) -> float | None:
    """OpenAI's ``prompt_cache_retention`` in seconds: ``"24h"`` a day, anything else nothing."""
    return EXTENDED_S if value == "24h" else None
