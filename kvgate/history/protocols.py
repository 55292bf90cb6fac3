"""Model protocol profiles: how each model family carries reasoning across turns.

What matters for the prefix cache is what the engine renders: which field it reads reasoning from,
whether its chat template strips the reasoning of earlier turns by itself, whether the provider
requires reasoning back when tools were used, and what kvgate does with a completed turn's reasoning
(the turn-boundary policy: ``keep``, ``drop`` or ``truncate:N`` tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

Strips = Literal["never", "before_last_user", "always", "after_final", "outside_tool_chain"]
"""When the model's chat template itself removes reasoning of earlier assistant messages."""


@dataclass(frozen=True, slots=True)
class ReasoningPolicy:
    mode: Literal["keep", "drop", "truncate"]
    tokens: int = 0
    """For ``truncate``: how many tokens of reasoning a completed turn keeps (the model's tokens when
    kvgate has its tokenizer, words otherwise)."""

    @classmethod
    def parse(cls, text: str) -> ReasoningPolicy:
        t = text.strip().lower()
        if t in ("keep", "drop"):
            return cls(t)  # type: ignore[arg-type]
        if t.startswith("truncate:"):
            n = t.split(":", 1)[1]
            if n.isdigit() and int(n) > 0:
                return cls("truncate", int(n))
        raise ValueError(f"reasoning policy must be keep, drop or truncate:N (N > 0), got {text!r}")

    def __str__(self) -> str:
        return f"truncate:{self.tokens}" if self.mode == "truncate" else self.mode


@dataclass(frozen=True, slots=True)
class ModelProtocol:
    name: str
    reasoning_in: str
    """The message field the engine reads reasoning from on input (vLLM: ``reasoning`` only)."""
    reasoning_out: tuple[str, ...]
    """Fields responses carry reasoning in (and clients echo back)."""
    template_strips: Strips
    reasoning_required_with_tools: bool = False
    """DeepSeek thinking mode: a turn that called tools must keep its reasoning in later requests."""
    preserve_thinking_kwarg: str | None = None
    """A chat_template_kwargs flag that makes the template keep earlier reasoning (Qwen3.6+)."""
    policy: ReasoningPolicy = ReasoningPolicy("keep")

    def with_policy(self, policy: ReasoningPolicy) -> ModelProtocol:
        return replace(self, policy=policy)


PROFILES: dict[str, ModelProtocol] = {p.name: p for p in (
    ModelProtocol("generic-vllm", "reasoning", ("reasoning", "reasoning_content"), "never"),
    ModelProtocol("qwen3", "reasoning", ("reasoning", "reasoning_content"), "before_last_user",
                  preserve_thinking_kwarg="preserve_thinking"),
    ModelProtocol("deepseek-v3", "reasoning_content", ("reasoning_content", "reasoning"), "before_last_user",
                  reasoning_required_with_tools=True),
    ModelProtocol("deepseek-r1", "reasoning_content", ("reasoning_content", "reasoning"), "always"),
    ModelProtocol("gpt-oss", "reasoning", ("reasoning", "reasoning_content"), "after_final"),
    ModelProtocol("kimi-k2", "reasoning_content", ("reasoning_content", "reasoning"), "outside_tool_chain"),
    # The project's tiny model: a Qwen3-style template (tokens/template_qwen3.py), served by vLLM.
    ModelProtocol("kvgate-tiny", "reasoning", ("reasoning", "reasoning_content"), "before_last_user"),
)}


def get_protocol(name: str) -> ModelProtocol:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown model protocol {name!r}; expected one of {sorted(PROFILES)}") from None
