"""Test models that carry each model protocol's real chat template.

Every profile gets a directory with the tiny model's random weights and tokenizer builder, its own
template (``data/templates``, with license and NOTICE there) and the added tokens the template writes,
marked special as the real tokenizer marks them. The vLLM flags are the ones a production deployment of
that model family uses: auto tool choice with the family's tool parser and reasoning parser. The
reasoning config names where the model's reasoning starts, so that ``thinking_token_budget`` can end a
random model's reasoning and the tool-call grammar (structured outputs) takes over.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvgate.tokens.tinymodel import TokenSet

TEMPLATES = Path(__file__).resolve().parents[2] / "data" / "templates"

_QWEN = (("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True), ("<think>", False),
         ("</think>", False), ("<tool_call>", False), ("</tool_call>", False), ("<tool_response>", False),
         ("</tool_response>", False))
_DEEPSEEK = (("<｜begin▁of▁sentence｜>", True), ("<｜end▁of▁sentence｜>", True), ("<｜User｜>", False),
             ("<｜Assistant｜>", False), ("<｜tool▁calls▁begin｜>", False), ("<｜tool▁calls▁end｜>", False),
             ("<｜tool▁call▁begin｜>", False), ("<｜tool▁call▁end｜>", False), ("<｜tool▁sep｜>", False),
             ("<｜tool▁outputs▁begin｜>", False), ("<｜tool▁outputs▁end｜>", False),
             ("<｜tool▁output▁begin｜>", False), ("<｜tool▁output▁end｜>", False))
_KIMI = (("<|im_user|>", True), ("<|im_assistant|>", True), ("<|im_system|>", True), ("<|im_middle|>", True),
         ("<|tool_calls_section_begin|>", True), ("<|tool_calls_section_end|>", True),
         ("<|tool_call_begin|>", True), ("<|tool_call_argument_begin|>", True), ("<|tool_call_end|>", True),
         ("<|media_start|>", True), ("<|media_content|>", True), ("<|media_pad|>", True), ("<|media_end|>", True))
ALL_TOKENS = _QWEN + _DEEPSEEK + _KIMI
"""One set for every profile: the same tokenizer.json (same ids) whichever template a model carries."""


@dataclass(frozen=True)
class TemplateModel:
    profile: str
    """kvgate's model protocol profile (``history/protocols.py``)."""
    template: str
    """File under ``data/templates``."""
    tokens: TokenSet
    tool_parser: str
    reasoning_parser: str
    reasoning_start: str
    """Where the template leaves the model to reason (the generation prompt's tail)."""
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    """``chat_template_kwargs`` the family's clients send (DeepSeek: ``thinking``)."""

    @property
    def served(self) -> str:
        return f"kvgate-{self.profile}"

    def source(self) -> str:
        return (TEMPLATES / self.template).read_text()

    def vllm_args(self) -> tuple[str, ...]:
        return ("--enable-auto-tool-choice", "--tool-call-parser", self.tool_parser,
                "--reasoning-parser", self.reasoning_parser,
                "--reasoning-config", json.dumps({"reasoning_start_str": self.reasoning_start,
                                                  "reasoning_end_str": "</think>"}),
                # A random model fills free JSON whitespace forever; compact JSON ends the call.
                "--structured-outputs-config", json.dumps({"backend": "xgrammar", "disable_any_whitespace": True}))


TEMPLATE_MODELS: dict[str, TemplateModel] = {m.profile: m for m in (
    TemplateModel("qwen3", "qwen3.jinja", TokenSet(ALL_TOKENS, eos="<|im_end|>"), "hermes", "qwen3",
                  "<|im_start|>assistant\n"),
    TemplateModel("deepseek-v3", "deepseek-v3.2.vllm.jinja",
                  TokenSet(ALL_TOKENS, eos="<｜end▁of▁sentence｜>", bos="<｜begin▁of▁sentence｜>"),
                  "deepseek_v31", "deepseek_v3", "<think>", {"thinking": True}),
    TemplateModel("deepseek-r1", "deepseek-r1.vllm.jinja",
                  TokenSet(ALL_TOKENS, eos="<｜end▁of▁sentence｜>", bos="<｜begin▁of▁sentence｜>"),
                  "deepseek_v3", "deepseek_r1", "<｜Assistant｜>"),
    TemplateModel("kimi-k2", "kimi-k2-thinking.jinja", TokenSet(ALL_TOKENS, eos="<|im_end|>"), "kimi_k2", "kimi_k2",
                  "<|im_middle|>"),
)}
