"""The gateway's turn service over conversation records: protocols, canonical history with the record's
exact replies, stateful continuation, and the completed turn's chain."""

from __future__ import annotations

from typing import Any

import pytest

from kvgate.gateway.prompts import PromptBuilder
from kvgate.gateway.turns import Reply, TurnService
from kvgate.history.continuation import HistoryConflict, UnknownResponse
from kvgate.router.hashing import VllmHasher
from kvgate.router.types import ConversationId
from kvgate.session.conversation import Conversation, Limits
from kvgate.tokens.tokenizer import ChatTokenizer

M = "kvgate-tiny"


def service(tok: ChatTokenizer, policy: str = "keep") -> TurnService:
    async def none(model: str, body: dict[str, Any]) -> list[int] | None:
        return None

    return TurnService({}, policy, {}, PromptBuilder({M: tok}, {M: VllmHasher(16, seed="0")}, none), Limits())


def test_truncate_counts_model_tokens_when_the_tokenizer_is_known(tokenizer: ChatTokenizer) -> None:
    t = service(tokenizer, "truncate:3")
    msgs = [{"role": "user", "content": "q"},
            {"role": "assistant", "content": "a", "reasoning": "the cache of the model is warm"},
            {"role": "user", "content": "next"}]
    out = t.canonical(t.protocol(M, "", None), msgs, None, M)
    assert len(tokenizer.encode(out.messages[1]["reasoning"])) == 3


def completed(t: TurnService, msgs: list[dict[str, Any]], reply: dict[str, Any]) -> Conversation:
    chain = t.chain_for(M, msgs, reply, None, None)
    return Conversation(ConversationId("c")).with_reply(M, tuple(msgs), reply, None, chain, "resp-1", Limits())


def test_a_completed_turn_keeps_its_exact_reply_and_chain(tokenizer: ChatTokenizer) -> None:
    t = service(tokenizer)
    msgs = [{"role": "user", "content": "find it"}]
    reply = Reply(content="", reasoning="look", calls={0: {"id": "c1", "type": "function", "function": {
        "name": "search", "arguments": '{"q":1,"k":2}'}}}).message()
    conv = completed(t, msgs, reply)
    assert conv.exact == (reply,) and conv.history == (*msgs, reply) and conv.responses == ("resp-1",)
    assert conv.chain is not None
    assert list(conv.chain.tokens) == tokenizer.encode(tokenizer.render_chat([*msgs, reply], None, False).rstrip("\n"))
    # A client that re-dumps the arguments and drops the reasoning gets the exact reply back.
    echoed = {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {
        "name": "search", "arguments": '{"k": 2, "q": 1}'}}]}
    out = t.canonical(t.protocol(M, "", None), [*msgs, echoed, {"role": "tool", "tool_call_id": "c1",
                                                                "content": "x"}], conv, M)
    assert out.messages[1] == reply and {r.field for r in out.restored} == {"reasoning_omitted",
                                                                            "tool_calls.arguments"}


def test_continuation_extends_the_stored_history_and_names_a_conflict(tokenizer: ChatTokenizer) -> None:
    t = service(tokenizer)
    conv = completed(t, [{"role": "system", "content": "S"}, {"role": "user", "content": "q"}],
                     {"role": "assistant", "content": "a"})
    new = [{"role": "user", "content": "more"}]
    assert t.continue_from(conv, new) == [*conv.history, *new]
    with pytest.raises(HistoryConflict) as exc:
        t.continue_from(conv, [{"role": "system", "content": "other"}, *new])
    assert exc.value.index == 0
    with pytest.raises(UnknownResponse):
        t.continue_from(None, new)


def test_the_next_turn_prefix_is_a_prefix_of_the_next_prompt(tokenizer: ChatTokenizer) -> None:
    t = service(tokenizer, "drop")
    msgs = [{"role": "user", "content": "q"}]
    conv = completed(t, msgs, {"role": "assistant", "content": "answer", "reasoning": "long thought " * 20})
    prefix = t.next_turn_prefix(conv, t.protocol(M, "", None))
    assert prefix is not None
    nxt = t.canonical(t.protocol(M, "", None), [*conv.history, {"role": "user", "content": "and?"}], conv, M)
    assert tokenizer.encode(tokenizer.render_chat(nxt.messages))[: len(prefix)] == prefix
