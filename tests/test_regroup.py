"""session/regroup.py: which messages identify a keyless conversation, and the vote."""

from __future__ import annotations

import json

from kvgate.router.types import ConversationId
from kvgate.session.regroup import ALIAS, INDEX_TAIL, index_digests, lookup_digests, message_digest, vote

LONG = "the tool printed this rather long line of output " * 2


def call(args: str) -> dict[str, object]:
    return {"role": "assistant", "content": "", "reasoning": "let me think",
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "grep", "arguments": args}}]}


def test_a_message_is_digested_by_what_it_says() -> None:
    exact = call(json.dumps({"pattern": "TODO", "path": "src/"}))
    redumped = call(json.dumps({"path": "src/", "pattern": "TODO"}, indent=2))
    no_reasoning = {**exact, "reasoning": None}
    assert message_digest(exact) == message_digest(redumped) == message_digest(no_reasoning)
    assert message_digest(exact) != message_digest(call(json.dumps({"pattern": "FIXME", "path": "src/"})))
    parts = {"role": "tool", "content": [{"type": "text", "text": LONG}]}
    assert message_digest(parts) == message_digest({"role": "tool", "content": LONG})
    assert message_digest({"role": "user", "content": LONG}) != message_digest({"role": "tool", "content": LONG})


def test_messages_every_conversation_shares_are_not_evidence() -> None:
    assert message_digest({"role": "system", "content": LONG}) is None
    assert message_digest({"role": "developer", "content": LONG}) is None
    assert message_digest({"role": "user", "content": "continue"}) is None
    assert message_digest({"role": "user", "content": {"not": "text"}}) is None
    assert message_digest({"content": LONG}) is None


def test_lookups_take_the_alias_first_then_the_head_and_tail() -> None:
    msgs = [{"role": "system", "content": LONG}] + [{"role": "user", "content": f"{LONG} {i}"} for i in range(100)]
    got = lookup_digests(msgs, "d-1")
    assert got[0] == ALIAS + "d-1" and len(got) == 1 + 8 + 24
    assert got[1] == message_digest(msgs[1]) and got[-1] == message_digest(msgs[-1])


def test_a_turn_files_its_tail_and_reply_only() -> None:
    msgs = [{"role": "user", "content": f"{LONG} {i}"} for i in range(40)]
    reply = {"role": "assistant", "content": LONG + " answer"}
    got = index_digests(msgs, reply, None)
    assert len(got) == INDEX_TAIL + 1 and got[-1] == message_digest(reply)
    assert index_digests(msgs, None, ConversationId("d-9"))[0] == ALIAS + "d-9"


def test_vote() -> None:
    a, b = ConversationId("a"), ConversationId("b")
    assert vote([b, a, a, a]) == b  # the alias decides
    assert vote([None, a, b, a, None]) == a
    assert vote([None, a, b]) is None  # shared messages say nothing
    assert vote([None, None]) is None and vote([]) is None


def test_hostile_arguments_are_digested_as_text_not_parsed_past_the_limits() -> None:
    deep = call("[" * 100_000)
    d = message_digest(deep)
    assert d is not None and d == message_digest(call("[" * 100_000)) != message_digest(call("[" * 99_999))
