"""Every token of history that could have been reused and was not, with its cause.

The previous request's chain (its prompt plus what the worker generated — the engine's own token ids
when it returned them) is compared with the new prompt. What the new prompt could have reused is the
chain up to the new prompt's last token; what it reused at best is its longest common prefix with the
chain in whole blocks. The loss is attributed where the tokens diverge: the first differing token is
mapped to the message that holds it (the token→message map of the new prompt), and the cause is read
there:

- ``retokenization`` — the engine generated other tokens than the template renders for the same text
  (kvgate's rendering of the same messages goes on matching the new prompt past the divergence);
- ``reasoning_dropped`` — the message is unchanged but for its reasoning, or unchanged and rendered
  without its reasoning (the template or the policy removed it: expected, and what background prefill
  of the canonical branch recovers);
- ``system_prompt_changed`` — message 0 (system) changed;
- ``reserialization`` — same meaning, different tokens (restoration off or impossible), field named;
- ``client_edit`` — the client changed message i (or cut the history);
- ``template`` — an unchanged message without reasoning that the template renders differently once the
  conversation moved on;
- ``block_alignment`` — no token differs: only the partial last block (vLLM caches whole blocks).

A change that alters no token is not a loss: the divergence is found on tokens, so spacing a template
normalises away never gets a cause. Then the cache itself: of the prefix that was reusable, what the
worker did not report as cached was ``rerouted`` (another worker held more of it) or ``evicted`` (no
worker held it). The causes add up to the measured loss by construction. Pure: no I/O.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvgate.history.canonical import REASONING_FIELDS, reasoning_of, reserialization
from kvgate.sequences import common_prefix

CAUSES = ("reasoning_dropped", "client_edit", "reserialization", "system_prompt_changed", "retokenization",
          "template", "evicted", "rerouted", "block_alignment")


@dataclass(frozen=True, slots=True)
class PromptLoss:
    reusable: int
    """Tokens of the previous chain the new prompt could have reused."""
    best: int
    """Of those, the tokens in its common prefix with the chain, in whole blocks."""
    cause: str | None
    detail: str = ""
    diverged_at: int | None = None
    """The first token where the chain and the new prompt differ (None when they do not)."""

    @property
    def lost(self) -> int:
        return self.reusable - self.best


_RENDERED = ("role", "content", "tool_calls", "tool_call_id", "name")


def _same(a: Mapping[str, Any], b: Mapping[str, Any], with_reasoning: bool = True) -> bool:
    if not all(a.get(k) == b.get(k) for k in _RENDERED):
        return False
    return not with_reasoning or reasoning_of(a)[0] == reasoning_of(b)[0]


def message_at(starts: Sequence[int], token: int) -> int:
    """The message holding ``token``, given where each message starts (``starts[i]``: the first token
    of message i; a message's closing tokens are counted with the next one)."""
    return max(0, bisect.bisect_right(starts, token) - 1)


def explain_prompt(chain: Sequence[int], prompt: Sequence[int], block_size: int,
                   chain_messages: Sequence[Mapping[str, Any]], messages: Sequence[Mapping[str, Any]],
                   policy_changed: Sequence[int] = (), starts: Sequence[int] | None = None,
                   rendered_chain: Sequence[int] | None = None, computed: int | None = None) -> PromptLoss:
    """The loss of ``prompt`` against the previous ``chain``.

    ``starts`` maps the new prompt's tokens to ``messages`` (see ``message_at``); without it the first
    message whose content differs is named. ``rendered_chain`` is the chain as the template renders it
    (the previous history plus the reply) when ``chain`` holds the tokens the engine generated.
    ``computed``: how many of the chain's tokens the engine holds KV for — its prompt and all it
    generated but the last token, whose KV no engine computes. A reply ending on a block boundary
    leaves that block incomplete: its tokens are partial-block loss, not a cache miss."""
    reusable = min(len(chain), max(0, len(prompt) - 1), len(chain) if computed is None else max(0, computed))
    lcp = min(common_prefix(chain, prompt), reusable)
    best = (lcp // block_size) * block_size
    if best >= reusable:
        return PromptLoss(reusable, best, None)
    if lcp >= reusable:
        return PromptLoss(reusable, best, "block_alignment", "the last partial block is not cached", None)
    if rendered_chain is not None and common_prefix(rendered_chain, prompt) > lcp:
        at = message_at(starts, lcp) if starts is not None else len(chain_messages) - 1
        return PromptLoss(reusable, best, "retokenization",
                          f"message {at}: the engine generated other tokens than the template renders", lcp)
    cause, detail = (_cause_at(message_at(starts, lcp), chain_messages, messages, policy_changed)
                     if starts is not None else _first_changed(chain_messages, messages, policy_changed))
    return PromptLoss(reusable, best, cause, detail, lcp)


def _cause_at(i: int, chain_messages: Sequence[Mapping[str, Any]], messages: Sequence[Mapping[str, Any]],
              policy_changed: Sequence[int]) -> tuple[str, str]:
    if i >= len(messages):
        return "client_edit", f"history cut at message {len(messages)}"
    if i >= len(chain_messages):
        # The previous history matches up to its end; the tokens after it are the template's, not a message's.
        return "template", f"message {i}: the template closes the previous turn differently"
    old, new = chain_messages[i], messages[i]
    if _same(old, new):
        if reasoning_of(old)[0] is not None:
            return "reasoning_dropped", f"message {i} (template)"
        return "template", f"message {i}: rendered differently once the conversation moved on"
    return _changed(i, old, new, policy_changed)


def _changed(i: int, old: Mapping[str, Any], new: Mapping[str, Any], policy_changed: Sequence[int]
             ) -> tuple[str, str]:
    if i == 0 and old.get("role") in ("system", "developer") and old.get("content") != new.get("content"):
        return "system_prompt_changed", "message 0"
    if _same(old, new, with_reasoning=False):
        by = "policy" if i in policy_changed else "template or client"
        return "reasoning_dropped", f"message {i} ({by})"
    fields = reserialization(new, old)
    if fields:
        return "reserialization", f"message {i}: {', '.join(fields)}"
    return "client_edit", f"message {i}"


def _first_changed(chain_messages: Sequence[Mapping[str, Any]], messages: Sequence[Mapping[str, Any]],
                   policy_changed: Sequence[int]) -> tuple[str, str]:
    """Without a token map: the first message whose content differs."""
    for i, (old, new) in enumerate(zip(chain_messages, messages, strict=False)):
        if not _same(old, new):
            return _changed(i, old, new, policy_changed)
    if len(messages) < len(chain_messages):
        return "client_edit", f"history cut at message {len(messages)}"
    # Same messages, different tokens: the template rendered an earlier message differently once the
    # conversation moved on (Qwen3, DeepSeek and gpt-oss templates strip earlier reasoning).
    return "reasoning_dropped", "template"


def explain_cache(best: int, cached: int, chosen_matched_tokens: int, best_matched_tokens: int
                  ) -> tuple[int, str | None]:
    """Of the reusable prefix, what the worker did not have: (tokens, cause)."""
    missing = max(0, best - cached)
    if missing == 0:
        return 0, None
    return missing, ("rerouted" if best_matched_tokens > chosen_matched_tokens else "evicted")


__all__ = ["CAUSES", "REASONING_FIELDS", "PromptLoss", "explain_cache", "explain_prompt", "message_at"]
