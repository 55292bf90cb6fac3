"""The gateway's side of turn-scoped reasoning: which protocol and policy apply to a request, the
canonical history it forwards, the exact replies it keeps, and the explanation of every lost prefix."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvgate.errors import BadRequest
from kvgate.gateway.history import Canonical, ExactStore, Message, canonicalize
from kvgate.gateway.loss import PromptLoss, explain_prompt
from kvgate.gateway.prompts import PromptBuilder
from kvgate.gateway.protocols import PROFILES, ModelProtocol, ReasoningPolicy, get_protocol


@dataclass
class Reply:
    """The assistant message being generated, assembled from a response or its stream."""

    content: str = ""
    reasoning: str = ""
    calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    complete: bool = False

    def add_delta(self, delta: Mapping[str, Any]) -> None:
        self.content += delta.get("content") or ""
        self.reasoning += delta.get("reasoning") or delta.get("reasoning_content") or ""
        for tc in delta.get("tool_calls") or []:
            if not isinstance(tc, dict):
                continue
            slot = self.calls.setdefault(int(tc.get("index", len(self.calls))),
                                         {"id": None, "type": "function", "function": {"name": None, "arguments": ""}})
            slot["id"] = slot["id"] or tc.get("id")
            fn = tc.get("function") or {}
            slot["function"]["name"] = slot["function"]["name"] or fn.get("name")
            slot["function"]["arguments"] += fn.get("arguments") or ""

    def set_message(self, m: Mapping[str, Any]) -> None:
        self.content = m.get("content") or ""
        self.reasoning = m.get("reasoning") or m.get("reasoning_content") or ""
        self.calls = {i: dict(c) for i, c in enumerate(m.get("tool_calls") or [])}
        self.complete = True

    def message(self) -> Message:
        msg: Message = {"role": "assistant", "content": self.content}
        if self.reasoning:
            msg["reasoning"] = self.reasoning
        if self.calls:
            msg["tool_calls"] = [self.calls[i] for i in sorted(self.calls)]
        return msg


@dataclass
class _Last:
    messages: list[Message]
    reply: Message


class TurnKeeper:
    def __init__(self, protocols: Mapping[str, str], default_policy: str, tenant_policies: Mapping[str, str],
                 prompts: PromptBuilder, max_conversations: int = 10_000) -> None:
        self._protocols = {m: get_protocol(p) for m, p in protocols.items()}
        self._default = ReasoningPolicy.parse(default_policy)
        self._tenant = {t: ReasoningPolicy.parse(p) for t, p in tenant_policies.items()}
        self._prompts = prompts
        self.exact = ExactStore(max_conversations)
        self._last: OrderedDict[str, _Last] = OrderedDict()
        self._max = max_conversations

    def protocol(self, model: str, tenant: str, requested: str | None) -> ModelProtocol:
        base = self._protocols.get(model) or PROFILES.get(model) or PROFILES["generic-vllm"]
        policy = self._tenant.get(tenant, self._default)
        if requested is not None:
            try:
                policy = ReasoningPolicy.parse(requested)
            except ValueError as exc:
                raise BadRequest(str(exc), param="reasoning_policy", code="invalid_value") from exc
        return base.with_policy(policy)

    def canonical(self, protocol: ModelProtocol, messages: list[Message], conversation: str) -> Canonical:
        def truncate(text: str, n: int) -> str:
            return " ".join(text.split(" ")[:n])

        return canonicalize(messages, protocol, self.exact, conversation, truncate)

    def explain(self, model: str, conversation: str, tokens: tuple[int, ...] | None, block_size: int,
                canonical: Canonical, tools: Any) -> PromptLoss | None:
        last = self._last.get(conversation)
        if last is None or tokens is None:
            return None
        chain = self._prompts.render_tokens(model, [*last.messages, last.reply], tools, f"{conversation}#chain")
        if chain is None:
            return None
        return explain_prompt(chain, tokens, block_size, [*last.messages, last.reply], canonical.messages,
                              canonical.reasoning_changed)

    def completed(self, conversation: str, messages: list[Message], reply: Reply) -> None:
        msg = reply.message()
        self.exact.add(conversation, msg)
        self._last[conversation] = _Last(messages, msg)
        self._last.move_to_end(conversation)
        while len(self._last) > self._max:
            self._last.popitem(last=False)
