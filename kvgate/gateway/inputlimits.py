"""Limits that keep one client's hostile or oversized input from hurting others (docs/hostile-input.md):
the settings, and the cheap prompt-size bound checked before any rendering or tokenizing."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvgate.errors import BadRequest
from kvgate.settings.limits import HostileSettings

UNKNOWN_TOKEN_CHARS = 256
"""Characters one token may cover for a model without a local tokenizer (real vocabularies stay under
~130: runs of spaces or dashes in code models)."""


class PromptLimits:
    """Per model, the most prompt tokens accepted and the most characters one token covers."""

    def __init__(self, settings: HostileSettings, token_chars: Mapping[str, int],
                 tokenizer_limits: Mapping[str, int]) -> None:
        self.settings = settings
        self.token_chars = dict(token_chars)
        self.learned: dict[str, int] = {}
        """Context lengths the workers reported (``learn``)."""
        self.tokenizer_limits = dict(tokenizer_limits)

    def limit(self, model: str) -> int | None:
        if self.settings.max_prompt_tokens is not None:
            return self.settings.max_prompt_tokens
        return self.learned.get(model) or self.tokenizer_limits.get(model)

    def learn(self, model: str, max_model_len: int) -> None:
        """A worker's context length; a model's limit is its smallest worker's (any may get the prompt)."""
        if max_model_len > 0:
            self.learned[model] = min(self.learned.get(model, max_model_len), max_model_len)

    def check_chars(self, model: str, endpoint: str, body: Mapping[str, Any]) -> None:
        """Refuse a prompt whose text alone is too long for the context, before rendering or tokenizing."""
        limit = self.limit(model)
        if limit is None:
            return
        at_least = text_chars(endpoint, body) // self.token_chars.get(model, UNKNOWN_TOKEN_CHARS)
        if at_least > limit:
            raise context_exceeded(at_least, limit, exact=False)

    def check_tokens(self, model: str, tokens: int) -> None:
        limit = self.limit(model)
        if limit is not None and tokens > limit:
            raise context_exceeded(tokens, limit, exact=True)


def context_exceeded(tokens: int, limit: int, exact: bool) -> BadRequest:
    """vLLM's and OpenAI's answer to a prompt over the context length, same code and wording."""
    count = f"{tokens}" if exact else f"at least {tokens}"
    return BadRequest(f"This model's maximum context length is {limit} tokens. However, your request has "
                      f"{count} input tokens. Please reduce the length of the input messages.",
                      param="messages", code="context_length_exceeded")


def text_chars(endpoint: str, body: Mapping[str, Any]) -> int:
    """Characters of text the prompt is made of (message contents, reasoning, tool-call arguments, tool
    schemas; a completion's prompt): a lower bound on the rendered prompt's length, in O(fields)."""
    if endpoint != "chat":
        p = body.get("prompt")
        if isinstance(p, str):
            return len(p)
        if isinstance(p, list) and p and all(isinstance(x, str) for x in p):
            return max(len(x) for x in p)  # each string is its own prompt
        return 0
    n = 0
    for m in body.get("messages") or ():
        if not isinstance(m, dict):
            continue
        for f in ("content", "reasoning", "reasoning_content"):
            v = m.get(f)
            if isinstance(v, str):
                n += len(v)
            elif isinstance(v, list):
                n += sum(len(p["text"]) for p in v if isinstance(p, dict) and isinstance(p.get("text"), str))
        for c in m.get("tool_calls") or ():
            fn = c.get("function") if isinstance(c, dict) else None
            a = fn.get("arguments") if isinstance(fn, dict) else None
            n += len(a) if isinstance(a, str) else 0
    return n


def context_length(models: Any) -> int | None:
    """A worker's context length from its /v1/models answer (``max_model_len``: vLLM and SGLang both report
    it); None when it does not say."""
    data = models.get("data") if isinstance(models, dict) else None
    for d in data if isinstance(data, list) else ():
        n = d.get("max_model_len") if isinstance(d, dict) else None
        if isinstance(n, int) and not isinstance(n, bool) and n > 0:
            return n
    return None
