"""The token ids a vLLM worker returns with ``return_token_ids``: the prompt as the engine tokenized it
and choice 0's output, read from a response (or its stream chunks) and removed from it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class EngineIds:
    prompt: list[int] = field(default_factory=list)
    output: list[int] = field(default_factory=list)

    @property
    def chain(self) -> list[int]:
        """What the worker holds after the turn: its prompt, then what it generated."""
        return self.prompt + self.output

    @classmethod
    def take(cls, obj: dict[str, Any], into: EngineIds | None = None) -> EngineIds | None:
        """Move the ids out of a response or chunk ``obj`` into ``into`` (a stream adds chunk by chunk).
        None when the response carried no prompt ids (an engine that ignores the flag)."""
        got = into or cls()
        prompt = obj.pop("prompt_token_ids", None)
        if isinstance(prompt, list):
            got.prompt = [int(t) for t in prompt]
        for ch in obj.get("choices") or []:
            if not isinstance(ch, dict):
                continue
            ids = ch.pop("token_ids", None)
            if ch.get("index", 0) == 0 and isinstance(ids, list):
                got.output.extend(int(t) for t in ids)
            if isinstance(ch.get("delta"), dict):
                ch["delta"].pop("token_ids", None)
        return got if got.prompt else into
