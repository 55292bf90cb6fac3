"""The memory conversation store and the conversation record's bounds."""

from __future__ import annotations

import random
import tracemalloc
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


def like_a_turn(i: int, tokens: int = 2_500, block: int = 16) -> Conversation:
    """A record as the gateway keeps one after a ~2,500-token turn: the history and reply as sent, the
    chain's text and tokens, and the block hashes routing filled in."""
    rng = random.Random(i)
    text = " ".join(f"w{rng.randrange(10**6)}" for _ in range(tokens // 3))
    reply = {"role": "assistant", "content": f"done {i}"}
    chain = Chain(text, array("I", (rng.randrange(50_000) for _ in range(tokens))), array("I", [0, 3]),
                  array("I", [0, 1]))
    n = tokens // block
    chain.hashes[(block, "sha256_cbor", True)] = (block, [rng.randbytes(32) for _ in range(n)],
                                                  [rng.getrandbits(63) for _ in range(n)])
    return replace(new(f"c{i}"), model="m", history=({"role": "user", "content": text}, reply), exact=(reply,),
                   chain=chain, responses=(f"chatcmpl-{i}",), body_gen=1)


async def test_the_byte_bound_bounds_what_the_records_really_hold() -> None:
    """Fails on a0afb21: the size was estimated from string lengths, without the block hashes, the
    objects' headers or the response index, and the store held ~1.8x its bound."""
    bound = 1 << 20
    store = MemoryConversationStore(VirtualClock(), max_bytes=bound)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(120):  # ~8 MB of records through a 1 MiB store
            await store.update(C(f"c{i}"), lambda cur, i=i: like_a_turn(i))  # type: ignore[misc]
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert store.stats()["bytes"] <= bound
    assert 0.5 * bound < held <= 1.1 * bound, held
    assert 10 <= store.stats()["conversations"] < 30
    assert await store.conversation_of("chatcmpl-0") is None and len(store._responses) == store.stats()["conversations"]
