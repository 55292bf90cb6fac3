"""The gateway's side of turn-scoped reasoning, over a conversation's record: which protocol and policy
apply to a request, the canonical history it forwards, stateful continuations, the explanation of every
lost prefix token, the completed turn's new record, and the next turn's canonical prefix.

Stateless: everything per conversation lives in its record (``session/conversation.py``), so any
gateway replica continues any conversation.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvgate.errors import BadRequest
from kvgate.gateway.prompts import Prompt, PromptBuilder
from kvgate.history.canonical import Canonical, Message, canonicalize
from kvgate.history.continuation import UnknownResponse, continue_from
from kvgate.history.loss import PromptLoss, explain_prompt
from kvgate.history.protocols import PROFILES, ModelProtocol, ReasoningPolicy, get_protocol
from kvgate.session.conversation import Chain, Conversation, Limits
from kvgate.tokens.spans import anchored_token_starts

NEXT_TURN = "\x00kvgate-next-turn\x00"
"""The placeholder user message the next-turn prefix is cut before."""


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

    def tool_names(self) -> tuple[str, ...]:
        return tuple(str((c.get("function") or {}).get("name") or "") for c in self.calls.values())


class TurnService:
    def __init__(self, protocols: Mapping[str, str], default_policy: str, tenant_policies: Mapping[str, str],
                 prompts: PromptBuilder, limits: Limits) -> None:
        self._protocols = {m: get_protocol(p) for m, p in protocols.items()}
        self._default = ReasoningPolicy.parse(default_policy)
        self._tenant = {t: ReasoningPolicy.parse(p) for t, p in tenant_policies.items()}
        self._prompts = prompts
        self.limits = limits

    def protocol(self, model: str, tenant: str, requested: str | None) -> ModelProtocol:
        base = self._protocols.get(model) or PROFILES.get(model) or PROFILES["generic-vllm"]
        policy = self._tenant.get(tenant, self._default)
        if requested is not None:
            try:
                policy = ReasoningPolicy.parse(requested)
            except ValueError as exc:
                raise BadRequest(str(exc), param="reasoning_policy", code="invalid_value") from exc
        return base.with_policy(policy)

    def canonical(self, protocol: ModelProtocol, messages: Sequence[Mapping[str, Any]], conv: Conversation | None,
                  model: str | None = None) -> Canonical:
        def truncate(text: str, n: int) -> str:
            # In the model's tokens when kvgate has its tokenizer, in words otherwise.
            cut = self._prompts.truncate_tokens(model, text, n) if model else None
            return cut if cut is not None else " ".join(text.split(" ")[:n])

        return canonicalize(messages, protocol, conv.exact if conv is not None else (), truncate)

    @staticmethod
    def continue_from(conv: Conversation | None, messages: list[Message]) -> list[Message]:
        """The full history of a stateful continuation of ``conv`` (UnknownResponse when kvgate no longer
        holds its history)."""
        if conv is None or not conv.history:
            raise UnknownResponse("the conversation of this response is no longer held")
        return continue_from(conv.history, messages)

    @staticmethod
    def explain(conv: Conversation | None, prompt: Prompt, block_size: int, canonical: Canonical
                ) -> PromptLoss | None:
        """Every token of the conversation's chain the prompt could have reused and does not, with its
        cause, named where the tokens diverge (``history/loss.py``). The chain compared is the engine's
        own tokens when it returned them."""
        if conv is None or conv.chain is None or prompt.tokens is None:
            return None
        ch, pc = conv.chain, prompt.chain
        # A prompt known only as far as the chain and its first new block (``ChainTokenizer.head``): the
        # messages after the first new one are not in its text, and no token it knows can be theirs.
        msgs = canonical.messages if prompt.text is None else canonical.messages[: len(conv.history) + 1]
        starts = (anchored_token_starts(pc.text, pc.anchor_chars, pc.anchor_tokens, msgs)
                  if pc is not None else None)
        chain = ch.engine if ch.engine is not None else ch.tokens
        rendered = ch.tokens if ch.engine is not None else None
        last = conv.turns[-1] if conv.turns else None
        # No engine computes the KV of the last token it generates: a reply ending on a block boundary
        # leaves that block incomplete on the worker, which is alignment, not a cache miss.
        computed = last.active_context_tokens - 1 if last is not None and last.completion_tokens > 0 else None
        return explain_prompt(chain, prompt.tokens, block_size, conv.history, canonical.messages,
                              canonical.reasoning_changed, starts, rendered, computed)

    def chain_for(self, model: str, messages: Sequence[Message], reply: Message, tools: Any,
                  prompt_chain: Chain | None) -> Chain | None:
        """The completed turn's chain (history plus reply as the engine cached them); rendered after the
        response, not before the next request's first token."""
        return self._prompts.chain_for(model, [*messages, reply], tools, prompt_chain)

    def next_turn_prefix(self, conv: Conversation, protocol: ModelProtocol) -> list[int] | None:
        """The canonical prefix P|A the next request will start with: the history after this turn ends,
        rendered as it will be sent (this turn's reasoning kept, dropped or truncated per the policy),
        cut before a placeholder next user message. Background prefill warms exactly these tokens."""
        if not conv.history or not conv.model:
            return None
        canonical = self.canonical(protocol, [*conv.history, {"role": "user", "content": NEXT_TURN}], conv,
                                   conv.model)
        return self._prompts.render_prefix(conv.model, canonical.messages, conv.tools, NEXT_TURN)
