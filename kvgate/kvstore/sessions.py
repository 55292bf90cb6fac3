"""Conversation state behind a small async interface, so a Redis store can replace the in-memory one.

A ``get`` refreshes a conversation's expiry (it is in use); ``peek`` does not (observers, admin).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Protocol

from kvgate.clock import Clock
from kvgate.router.types import ConversationId, WorkerId


@dataclass(frozen=True, slots=True)
class TurnRecord:
    worker: WorkerId
    reason: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    ttft_s: float | None
    expected_cached_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Session:
    conversation_id: ConversationId
    id_source: str
    """How the id was found: ``header:<name>``, ``body`` or ``derived``."""
    home_worker: WorkerId | None = None
    last_activity: float = 0.0
    turns: tuple[TurnRecord, ...] = field(default_factory=tuple)

    def with_turn(self, turn: TurnRecord, now: float, keep_turns: int = 64) -> Session:
        return replace(self, home_worker=turn.worker, last_activity=now,
                       turns=(*self.turns, turn)[-keep_turns:])


class SessionStore(Protocol):
    async def get(self, cid: ConversationId) -> Session | None: ...

    async def peek(self, cid: ConversationId) -> Session | None: ...

    async def put(self, session: Session) -> None: ...

    async def delete(self, cid: ConversationId) -> bool: ...

    async def count(self) -> int: ...


class MemorySessionStore:
    """LRU-bounded, TTL-expiring sessions for one gateway process."""

    def __init__(self, clock: Clock, ttl_s: float = 3600.0, max_sessions: int = 100_000) -> None:
        self._clock = clock
        self._ttl = ttl_s
        self._max = max_sessions
        self._data: OrderedDict[ConversationId, tuple[Session, float]] = OrderedDict()

    def _live(self, cid: ConversationId) -> Session | None:
        item = self._data.get(cid)
        if item is None:
            return None
        session, expires = item
        if expires <= self._clock.now():
            del self._data[cid]
            return None
        return session

    async def get(self, cid: ConversationId) -> Session | None:
        s = self._live(cid)
        if s is not None:
            self._data[cid] = (s, self._clock.now() + self._ttl)
            self._data.move_to_end(cid)
        return s

    async def peek(self, cid: ConversationId) -> Session | None:
        return self._live(cid)

    async def put(self, session: Session) -> None:
        cid = session.conversation_id
        self._data[cid] = (session, self._clock.now() + self._ttl)
        self._data.move_to_end(cid)
        while len(self._data) > self._max:
            self._data.popitem(last=False)

    async def delete(self, cid: ConversationId) -> bool:
        return self._data.pop(cid, None) is not None

    async def count(self) -> int:
        return len(self._data)
