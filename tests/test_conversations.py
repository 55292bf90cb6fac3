"""The memory conversation store and the conversation record's bounds."""

from __future__ import annotations

import random
import tracemalloc
from array import array
from dataclasses import replace

from kvgate.clock import VirtualClock
from kvgate.gateway.record import shared_prefix
from kvgate.kvstore.conversations import MemoryConversationStore, held_bytes, record_bytes
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


def test_measuring_a_record_from_its_last_version_equals_measuring_it_afresh() -> None:
    """The store measures a record from the memo of its previous version (only new parts are walked):
    after random appends, evictions from the tuples' fronts, hashes added to the chain in place and
    records dropped, that must give what measuring it with no memo gives, and bound the full walk."""
    rng = random.Random(7)
    limits = Limits(max_turns=5, max_exact=4, max_responses=3)
    conv, memo = new("c"), None
    for i in range(60):
        if rng.random() < 0.1:
            conv, memo = new("c"), None  # dropped and started again
        msgs = tuple({"role": "user", "content": f"m{j} " * rng.randrange(1, 50)} for j in range(i % 7 + 1))
        reply = {"role": "assistant", "content": "r" * rng.randrange(100)}
        chain = like_a_turn(i, tokens=rng.randrange(32, 600)).chain if rng.random() < 0.7 else conv.chain
        turn = TurnRecord(WorkerId(f"w{i % 3}"), "cost", i, 0, 1, 0.1, at=float(i))
        conv = conv.with_turn(turn, limits).with_reply("m", msgs, reply, None, chain, f"r{i}", limits)
        if conv.chain is not None and rng.random() < 0.3:  # routing fills in another identity's hashes
            conv.chain.hashes[(32, "x", i)] = (32, [rng.randbytes(32)], [rng.getrandbits(63)])
        size, memo = record_bytes(conv, memo)
        assert size == record_bytes(conv)[0], i
        assert size >= held_bytes(conv), i


async def test_the_store_counts_what_it_holds_after_reads_writes_and_drops() -> None:
    """``stats()["bytes"]`` is the sum of the records' sizes, each as measured afresh."""
    store = MemoryConversationStore(VirtualClock(), max_bytes=400_000)
    rng = random.Random(3)
    for i in range(200):
        cid = C(f"c{rng.randrange(12)}")
        if rng.random() < 0.2:
            await store.get(cid)
            continue
        if rng.random() < 0.05:
            await store.delete(cid)
            continue
        t = like_a_turn(i, tokens=rng.randrange(50, 2_000))
        await store.update(cid, lambda cur, t=t, cid=cid: replace(  # type: ignore[misc]
            t, id=cid, history=(*(cur.history if cur else ())[-6:], *t.history)))
    expect = sum(record_bytes(c)[0] + 200 + 100 * len(c.responses) for c, *_ in store._data.values())
    assert store.stats()["bytes"] == expect and expect <= 400_000


def test_a_turn_keeps_the_records_own_messages_where_the_request_repeats_them() -> None:
    """The history a turn records shares the messages the record already held (so the store measures only
    the new ones): equal ones up to the first difference, then the request's own."""
    held = ({"role": "system", "content": "s"}, {"role": "user", "content": "u1"},
            {"role": "assistant", "content": "a"})
    sent = [dict(m) for m in held] + [{"role": "user", "content": "u2"}]
    out = shared_prefix(sent, held)
    assert out == tuple(sent) and all(a is b for a, b in zip(out, held, strict=False)) and out[3] is sent[3]
    edited = [dict(m) for m in held]
    edited[1]["content"] = "u1 edited"
    out = shared_prefix(edited, held)
    assert out[0] is held[0] and out[1] is edited[1] and out[2] is edited[2]
    assert shared_prefix(sent, ()) == tuple(sent)
