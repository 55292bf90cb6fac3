"""Conversation state behind a small async interface, so a Redis store can replace the in-memory one.

A ``get`` refreshes a conversation's expiry (it is in use); ``peek`` does not (observers, admin).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import astuple, dataclass, field, replace
from typing import Any, Protocol

from kvgate.clock import Clock
from kvgate.gateway.lifecycle import Lifecycle
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
    lost_tokens: int = 0
    """History the prompt could have reused and did not (see gateway/loss.py)."""
    loss_cause: str | None = None
    loss_detail: str = ""
    cache_lost_tokens: int = 0
    """Reusable prefix the chosen worker did not have."""
    cache_loss_cause: str | None = None


@dataclass(frozen=True, slots=True)
class Session:
    conversation_id: ConversationId
    id_source: str
    """How the id was found: ``header:<name>``, ``body`` or ``derived``."""
    home_worker: WorkerId | None = None
    last_activity: float = 0.0
    turns: tuple[TurnRecord, ...] = field(default_factory=tuple)
    """The most recent turns (bounded); ``turn_count`` counts them all."""
    turn_count: int = 0
    version: int = 0
    """Bumped by every write; a store refuses a write based on a stale version (no lost updates)."""
    lifecycle: Lifecycle = field(default_factory=Lifecycle)
    """Where the session is between requests (gateway/lifecycle.py)."""

    def with_turn(self, turn: TurnRecord, now: float, keep_turns: int = 64,
                  lifecycle: Lifecycle | None = None) -> Session:
        return replace(self, home_worker=turn.worker, last_activity=now,
                       turns=(*self.turns, turn)[-keep_turns:], turn_count=self.turn_count + 1,
                       lifecycle=lifecycle or self.lifecycle)

    def to_json(self) -> dict[str, object]:
        return {"conversation_id": self.conversation_id, "id_source": self.id_source,
                "home_worker": self.home_worker, "last_activity": self.last_activity,
                "turns": [list(astuple(t)) for t in self.turns], "turn_count": self.turn_count,
                "version": self.version, "lifecycle": self.lifecycle.to_json()}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Session:
        return cls(ConversationId(d["conversation_id"]), d["id_source"],
                   WorkerId(d["home_worker"]) if d.get("home_worker") else None, float(d["last_activity"]),
                   tuple(TurnRecord(*t) for t in d.get("turns", [])), int(d.get("turn_count", 0)),
                   int(d.get("version", 0)),
                   Lifecycle.from_json(d["lifecycle"]) if d.get("lifecycle") else Lifecycle())


Updater = Callable[[Session | None], Session]


class SessionStore(Protocol):
    async def get(self, cid: ConversationId) -> Session | None: ...

    async def update(self, cid: ConversationId, fn: Updater) -> Session:
        """Read-modify-write that never loses a concurrent writer's update (retried on conflict)."""
        ...

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

    async def update(self, cid: ConversationId, fn: Updater) -> Session:
        # One event loop, no await between read and write: atomic as it stands.
        new = fn(self._live(cid))
        new = replace(new, version=new.version + 1)
        await self.put(new)
        return new

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
