"""Every token of history that could have been reused and was not, with its cause.

The previous request's chain (its prompt plus what the worker generated) is compared with the new
prompt. What the new prompt could have reused is the chain up to the new prompt's last token; what it
reused at best is its longest common prefix with the chain in whole blocks. The difference is
attributed to the first message that differs:

- ``reasoning_dropped`` — an assistant message equal but for its reasoning (the template or the policy
  removed it: expected, and what background prefill of the canonical branch recovers);
- ``system_prompt_changed`` — message 0 (system) changed;
- ``reserialization`` — same meaning, different bytes (restoration off or impossible), field named;
- ``client_edit`` — the client changed message i;
- ``block_alignment`` — no message differs: only the partial last block (vLLM caches whole blocks).

Then the cache itself: of the prefix that was reusable, what the worker did not report as cached was
``rerouted`` (another worker held more of it) or ``evicted`` (no worker held it). The causes add up to
the measured loss by construction. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvgate.gateway.history import REASONING_FIELDS, reserialization
from kvgate.gateway.prompts import common_prefix

CAUSES = ("reasoning_dropped", "client_edit", "reserialization", "system_prompt_changed", "evicted", "rerouted",
          "block_alignment")


@dataclass(frozen=True, slots=True)
class PromptLoss:
    reusable: int
    """Tokens of the previous chain the new prompt could have reused."""
    best: int
    """Of those, the tokens in its common prefix with the chain, in whole blocks."""
    cause: str | None
    detail: str = ""

    @property
    def lost(self) -> int:
        return self.reusable - self.best


_RENDERED = ("role", "content", "tool_calls", "tool_call_id", "name")


def _same(a: Mapping[str, Any], b: Mapping[str, Any], with_reasoning: bool = True) -> bool:
    keys = _RENDERED + (REASONING_FIELDS if with_reasoning else ())
    return all(a.get(k) == b.get(k) for k in keys)


def explain_prompt(chain: Sequence[int], prompt: Sequence[int], block_size: int,
                   chain_messages: Sequence[Mapping[str, Any]], messages: Sequence[Mapping[str, Any]],
                   policy_changed: Sequence[int] = ()) -> PromptLoss:
    reusable = min(len(chain), max(0, len(prompt) - 1))
    lcp = min(common_prefix(chain, prompt), reusable)
    best = (lcp // block_size) * block_size
    if best >= reusable:
        return PromptLoss(reusable, best, None)
    if lcp >= reusable:
        return PromptLoss(reusable, best, "block_alignment", "the last partial block is not cached")
    for i, (old, new) in enumerate(zip(chain_messages, messages, strict=False)):
        if _same(old, new):
            continue
        if i == 0 and old.get("role") in ("system", "developer"):
            return PromptLoss(reusable, best, "system_prompt_changed", "message 0")
        if _same(old, new, with_reasoning=False):
            by = "policy" if i in policy_changed else "template or client"
            return PromptLoss(reusable, best, "reasoning_dropped", f"message {i} ({by})")
        fields = reserialization(new, old)
        if fields:
            return PromptLoss(reusable, best, "reserialization", f"message {i}: {', '.join(fields)}")
        return PromptLoss(reusable, best, "client_edit", f"message {i}")
    if len(messages) < len(chain_messages):
        return PromptLoss(reusable, best, "client_edit", f"history cut at message {len(messages)}")
    # Same messages, different tokens: the template rendered an earlier message differently once the
    # conversation moved on (Qwen3, DeepSeek and gpt-oss templates strip earlier reasoning).
    return PromptLoss(reusable, best, "reasoning_dropped", "template")


def explain_cache(best: int, cached: int, chosen_matched_tokens: int, best_matched_tokens: int
                  ) -> tuple[int, str | None]:
    """Of the reusable prefix, what the worker did not have: (tokens, cause)."""
    missing = max(0, best - cached)
    if missing == 0:
        return 0, None
    return missing, ("rerouted" if best_matched_tokens > chosen_matched_tokens else "evicted")
