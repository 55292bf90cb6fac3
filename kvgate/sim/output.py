"""Turns a scripted completion into token ids and back into vLLM's response fields.

The generated text is tokenized once; each token's text is located in the text's spans (markup,
reasoning, content, tool call) so streaming deltas and the final message agree exactly, including
when ``max_tokens`` cuts the output short.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from kvgate.sim.behaviour import Script, ToolCall
from kvgate.tokens.tokenizer import ChatTokenizer

Kind = Literal["markup", "reasoning", "content", "tool"]


@dataclass(frozen=True, slots=True)
class Span:
    start: int
    end: int
    kind: Kind
    tool: ToolCall | None = None


@dataclass(slots=True)
class Delta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[tuple[int, ToolCall]] = field(default_factory=list)

    def empty(self) -> bool:
        return not (self.reasoning or self.content or self.tool_calls)


class RenderedOutput:
    """``token_ids`` is what the engine generates: the script's text then the end-of-turn token."""

    def __init__(self, script: Script, tok: ChatTokenizer, thinking: bool, max_tokens: int) -> None:
        self.script = script
        spans: list[Span] = []
        text = ""

        def add(s: str, kind: Kind, tool: ToolCall | None = None) -> None:
            nonlocal text
            if s:
                spans.append(Span(len(text), len(text) + len(s), kind, tool))
                text += s

        if thinking:
            add("<think>\n", "markup")
            add(script.reasoning, "reasoning")
            add("\n</think>\n\n", "markup")
        add(script.content, "content")
        for i, call in enumerate(script.tool_calls):
            sep = "\n" if (i > 0 or script.content) else ""
            add(sep + f'<tool_call>\n{{"name": "{call.name}", "arguments": {call.arguments}}}\n</tool_call>',
                "tool", call)
        ids = tok.encode(text) if text else []
        eos = tok.eos_token_id
        if eos is not None:
            ids.append(eos)
        self.full_len = len(ids)
        self.truncated = len(ids) > max_tokens
        self.token_ids = ids[:max_tokens]
        self.text = text
        self.spans = spans
        # Character end offset of each token within ``text`` (the end-of-turn token adds none).
        pieces = [tok.decode([i]) for i in ids]
        ends: list[int] = []
        pos = 0
        for i, p in zip(ids, pieces, strict=True):
            if i != eos:
                pos += len(p)
            ends.append(min(pos, len(text)))
        if pos != len(text):
            # Per-token decoding did not reproduce the text (multi-byte characters split across
            # tokens): fall back to cumulative decoding, exact but quadratic.
            body = [i for i in ids if i != eos]
            ends = [len(tok.decode(body[: min(k + 1, len(body))])) for k in range(len(ids))]
        self._ends = ends
        self._tool_index = {id(s.tool): n for n, s in enumerate(x for x in spans if x.kind == "tool")}

    def finish_reason(self) -> str:
        if self.truncated:
            return "length"
        return "tool_calls" if self.script.tool_calls else "stop"

    def delta(self, k: int) -> Delta:
        """What the k-th generated token (0-based) adds to the message."""
        a = self._ends[k - 1] if k > 0 else 0
        b = self._ends[k]
        d = Delta()
        for s in self.spans:
            lo, hi = max(a, s.start), min(b, s.end)
            if s.kind == "reasoning" and lo < hi:
                d.reasoning += self.text[lo:hi]
            elif s.kind == "content" and lo < hi:
                d.content += self.text[lo:hi]
            elif s.kind == "tool" and a < s.end <= b and s.tool is not None:
                d.tool_calls.append((self._tool_index[id(s.tool)], s.tool))
        return d

    def message(self) -> dict[str, Any]:
        """The non-streaming ``choices[0].message``, equal to all deltas joined."""
        reasoning, content = "", ""
        calls: list[tuple[int, ToolCall]] = []
        for k in range(len(self.token_ids)):
            d = self.delta(k)
            reasoning += d.reasoning
            content += d.content
            calls.extend(d.tool_calls)
        return {
            "role": "assistant",
            "content": content if (content or not calls) else None,
            "reasoning": reasoning or None,
            "tool_calls": [tool_call_json(c) for _, c in calls],
        }

    def plain_text(self) -> str:
        """For /v1/completions: the raw generated text (no parsing)."""
        end = self._ends[len(self.token_ids) - 1] if self.token_ids else 0
        return self.text[:end]


def tool_call_json(c: ToolCall) -> dict[str, Any]:
    return {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
