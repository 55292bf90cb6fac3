from kvgate.clock import VirtualClock
from kvgate.kvstore.sessions import MemorySessionStore, Session, TurnRecord
from kvgate.router.types import ConversationId, WorkerId

C = ConversationId


async def test_ttl_expiry_and_get_refreshes_but_peek_does_not() -> None:
    clock = VirtualClock()
    store = MemorySessionStore(clock, ttl_s=10)
    await store.put(Session(C("a"), "body"))
    await store.put(Session(C("b"), "body"))
    clock.advance_to(8)
    assert await store.get(C("a")) is not None  # refreshed to expire at 18
    assert await store.peek(C("b")) is not None  # not refreshed: still expires at 10
    clock.advance_to(12)
    assert await store.peek(C("a")) is not None
    assert await store.peek(C("b")) is None


async def test_bounded_by_lru() -> None:
    store = MemorySessionStore(VirtualClock(), max_sessions=2)
    for cid in ("a", "b"):
        await store.put(Session(C(cid), "body"))
    await store.get(C("a"))
    await store.put(Session(C("c"), "body"))
    assert await store.count() == 2
    assert await store.peek(C("b")) is None and await store.peek(C("a")) is not None


async def test_turns_move_home_and_are_bounded() -> None:
    s = Session(C("a"), "derived")
    for i in range(70):
        s = s.with_turn(TurnRecord(WorkerId(f"w{i % 2}"), "sticky", 10, 5, 1, 0.1), now=float(i))
    assert s.home_worker == "w1" and len(s.turns) == 64 and s.last_activity == 69.0
