"""The memory conversation store and the conversation record's bounds."""

from __future__ import annotations

from array import array
from dataclasses import replace

from kvgate.clock import VirtualClock
from kvgate.kvstore.conversations import MemoryConversationStore
from kvgate.router.types import ConversationId, WorkerId
from kvgate.session.conversation import Chain, Conversation, Limits, TurnRecord

C = ConversationId


def new(cid: str) -> Conversation:
    return Conversation(C(cid), "t", "body")


async def test_ttl_expiry_and_get_refreshes_but_peek_does_not() -> None:
    clock = VirtualClock()
    store = MemoryConversationStore(clock, ttl_s=10)
    await store.update(C("a"), lambda cur: new("a"))
    await store.update(C("b"), lambda cur: new("b"))
    clock.advance_to(8)
    assert await store.get(C("a")) is not None  # refreshed to expire at 18
    assert await store.peek(C("b")) is not None  # not refreshed: still expires at 10
    clock.advance_to(12)
    assert await store.peek(C("a")) is not None
    assert await store.peek(C("b")) is None


async def test_bounded_by_count_and_by_bytes() -> None:
    store = MemoryConversationStore(VirtualClock(), max_conversations=2)
    for cid in ("a", "b"):
        await store.update(C(cid), lambda cur, cid=cid: new(cid))  # type: ignore[misc]
    await store.get(C("a"))
    await store.update(C("c"), lambda cur: new("c"))
    assert store.stats()["conversations"] == 2
    assert await store.peek(C("b")) is None and await store.peek(C("a")) is not None
    big = MemoryConversationStore(VirtualClock(), max_bytes=200_000)
    msg = {"role": "user", "content": "x" * 50_000}
    for cid in "abcdef":
        await big.update(C(cid), lambda cur, cid=cid: replace(new(cid), history=(msg,)))  # type: ignore[misc]
    assert big.stats()["bytes"] <= 200_000 and await big.peek(C("a")) is None and await big.peek(C("f")) is not None


async def test_updates_version_and_index_response_ids() -> None:
    store = MemoryConversationStore(VirtualClock())
    a = await store.update(C("a"), lambda cur: replace(new("a"), responses=("r1",)))
    b = await store.update(C("a"), lambda cur: replace(cur, responses=("r1", "r2")) if cur else None)
    assert a is not None and b is not None and (a.version, b.version) == (1, 2)
    assert await store.conversation_of("r2") == "a" and await store.conversation_of("zz") is None
    assert await store.update(C("a"), lambda cur: None) == b  # declining writes nothing


def test_turns_move_home_and_are_bounded() -> None:
    c = new("a")
    for i in range(70):
        c = c.with_turn(TurnRecord(WorkerId(f"w{i % 2}"), "sticky", 10, 5, 1, 0.1, at=float(i)), Limits())
    assert c.home == "w1" and len(c.turns) == 64 and c.turn_count == 70 and c.last_activity == 69.0


def test_a_record_over_its_byte_bound_sheds_the_chain_then_old_replies_then_history() -> None:
    limits = Limits(max_bytes=30_000)
    chain = Chain("t" * 10_000, array("I", range(3_000)), array("I"), array("I"))
    reply = {"role": "assistant", "content": "r" * 4_000}
    c = new("a")
    for _ in range(3):
        c = c.with_reply("m", ({"role": "user", "content": "u" * 4_000},), reply, None, chain, None, limits)
    assert c.chain is None and len(c.exact) == 3 and c.body_bytes() <= 30_000
    huge = c.with_reply("m", ({"role": "user", "content": "u" * 40_000},), reply, None, chain, None, limits)
    assert huge.history == () and huge.body_bytes() <= 30_000
