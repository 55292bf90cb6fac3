"""The gateway's side of turn-scoped reasoning: which protocol and policy apply to a request, the
canonical history it forwards, the exact replies it keeps, and the explanation of every lost prefix."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvgate.errors import BadRequest
from kvgate.gateway.history import Canonical, ExactStore, Message, canonicalize, reserialization
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
    response_id: str | None = None
    tools: Any = None
    model: str = ""
    chain: list[int] | None = None
    """Tokens of the history plus reply, as the engine cached them (local tokenizer only)."""


class UnknownResponse(LookupError):
    """A stateful continuation names a response kvgate does not hold (expired or never seen)."""


class HistoryConflict(ValueError):
    """A stateful continuation's history disagrees with the stored one at ``index``."""

    def __init__(self, index: int) -> None:
        super().__init__(f"history differs from the stored conversation at message {index}")
        self.index = index


class TurnKeeper:
    def __init__(self, protocols: Mapping[str, str], default_policy: str, tenant_policies: Mapping[str, str],
                 prompts: PromptBuilder, max_conversations: int = 10_000) -> None:
        self._protocols = {m: get_protocol(p) for m, p in protocols.items()}
        self._default = ReasoningPolicy.parse(default_policy)
        self._tenant = {t: ReasoningPolicy.parse(p) for t, p in tenant_policies.items()}
        self._prompts = prompts
        self.exact = ExactStore(max_conversations)
        self._last: OrderedDict[str, _Last] = OrderedDict()
        self._responses: OrderedDict[str, str] = OrderedDict()
        """Response id -> conversation, for stateful continuations (``previous_response_id``)."""
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

    def canonical(self, protocol: ModelProtocol, messages: list[Message], conversation: str,
                  model: str | None = None) -> Canonical:
        def truncate(text: str, n: int) -> str:
            # In the model's tokens when kvgate has its tokenizer, in words otherwise.
            cut = self._prompts.truncate_tokens(model, text, n) if model else None
            return cut if cut is not None else " ".join(text.split(" ")[:n])

        return canonicalize(messages, protocol, self.exact, conversation, truncate)

    def explain(self, conversation: str, tokens: tuple[int, ...] | None, block_size: int,
                canonical: Canonical) -> PromptLoss | None:
        last = self._last.get(conversation)
        if last is None or last.chain is None or tokens is None:
            return None
        return explain_prompt(last.chain, tokens, block_size, [*last.messages, last.reply], canonical.messages,
                              canonical.reasoning_changed)

    def completed(self, conversation: str, messages: list[Message], reply: Reply, response_id: str | None = None,
                  tools: Any = None, model: str = "") -> None:
        msg = reply.message()
        self.exact.add(conversation, msg)
        # The chain the next request is compared with, rendered now: after the response, not before
        # the next one's first token.
        chain = self._prompts.render_tokens(model, [*messages, msg], tools, f"{conversation}#chain") if model else None
        self._last[conversation] = _Last(messages, msg, response_id, tools, model, chain)
        self._last.move_to_end(conversation)
        while len(self._last) > self._max:
            self._last.popitem(last=False)
        if response_id:
            self._responses[response_id] = conversation
            while len(self._responses) > self._max:
                self._responses.popitem(last=False)

    def conversation_of(self, response_id: str) -> str:
        cid = self._responses.get(response_id)
        if cid is None or cid not in self._last:
            raise UnknownResponse(f"no stored conversation has response `{response_id}`")
        return cid

    def continue_from(self, conversation: str, messages: list[Message]) -> list[Message]:
        """The full history of a stateful continuation: the stored history and reply, then the new
        messages. A client that resends history must resend the stored one (re-serialisations allowed);
        otherwise HistoryConflict names the first differing message."""
        last = self._last[conversation]
        stored = [*last.messages, last.reply]
        resent = (bool(messages) and messages[0].get("role") in ("system", "developer")) or (
            len(messages) > len(stored) and any(m.get("role") == "assistant" for m in messages[: len(stored)]))
        if resent:
            for i, (old, new) in enumerate(zip(stored, messages, strict=False)):
                if old == new:
                    continue
                if old.get("role") == "assistant" and reserialization(new, old) is not None:
                    continue
                if _text_equal(old, new):
                    continue
                raise HistoryConflict(i)
            if len(messages) < len(stored):
                raise HistoryConflict(len(messages))
            return [*stored, *messages[len(stored):]]
        return [*stored, *messages]

    def chain_tokens(self, conversation: str) -> tuple[int, ...] | None:
        """The tokens the worker cached for the conversation's last turn (history plus reply)."""
        last = self._last.get(conversation)
        return tuple(last.chain) if last and last.chain else None

    def last_model(self, conversation: str) -> str | None:
        last = self._last.get(conversation)
        return last.model if last else None

    def next_turn_prefix(self, model: str, conversation: str, protocol: ModelProtocol) -> list[int] | None:
        """The canonical prefix P|A the next request will start with: the history after this turn ends,
        rendered as it will be sent (this turn's reasoning kept, dropped or truncated per the policy),
        cut before a placeholder next user message. Background prefill warms exactly these tokens."""
        last = self._last.get(conversation)
        if last is None:
            return None
        placeholder = "\x00kvgate-next-turn\x00"
        canonical = self.canonical(protocol, [*last.messages, last.reply, {"role": "user", "content": placeholder}],
                                   conversation, model)
        return self._prompts.render_prefix(model, canonical.messages, last.tools, placeholder)


def _text_equal(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Same role and text (content as a string or as text parts)."""
    def text(m: Mapping[str, Any]) -> str:
        c = m.get("content")
        if isinstance(c, list):
            return "\n".join(p.get("text", "") for p in c if isinstance(p, dict))
        return c or ""

    return a.get("role") == b.get("role") and text(a) == text(b) and a.get("tool_call_id") == b.get("tool_call_id")
