"""Conversation records behind one small async interface: in this process's memory, or in Redis so that
every gateway replica reads and writes the same records (``kvstore/redis_conversations.py``).

``get`` refreshes a record's expiry (it is in use); ``peek`` does not (observers, admin). ``update`` is a
read-modify-write that never loses a concurrent writer's change: the function is re-applied to the
newer record when another writer (another request, another replica) got there first. It returns the
record written, or the current one when the function declines to write (returns None).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Protocol

from kvgate.clock import Clock
from kvgate.kvstore.corrupt import Corruption
from kvgate.router.types import ConversationId
from kvgate.session.conversation import Conversation

Updater = Callable[[Conversation | None], Conversation | None]


UNREAD: Any = object()
"""``update``'s ``known`` when the caller has not read the record."""


class StoreError(RuntimeError):
    """The store did not answer (Redis down or timed out) or holds an unreadable value; the gateway
    serves the request without the conversation's state rather than fail it."""


class ConversationStore(Protocol):
    async def get(self, cid: ConversationId) -> Conversation | None: ...

    async def peek(self, cid: ConversationId) -> Conversation | None: ...

    async def update(self, cid: ConversationId, fn: Updater, known: Conversation | None = UNREAD
                     ) -> Conversation | None:
        """``known``: the record as the caller last read it (None: there was none), tried first so a
        write that nobody raced costs one round trip."""
        ...

    async def delete(self, cid: ConversationId) -> bool: ...

    async def conversation_of(self, response_id: str) -> ConversationId | None:
        """The conversation a response id (``previous_response_id``) was issued in."""
        ...

    def stats(self) -> dict[str, int]:
        """What this process holds (records, bytes): cheap, for ``/metrics``."""
        ...

    async def close(self) -> None: ...

    @property
    def corruption(self) -> Corruption:
        """The corrupt values this store found (none in memory: nobody else writes it)."""
        ...


class MemoryConversationStore:
    """One process's records, bounded by count and by bytes (least recently used first), with a TTL."""

    def __init__(self, clock: Clock, ttl_s: float = 3600.0, max_conversations: int = 100_000,
                 max_bytes: int = 1 << 30) -> None:
        self._clock = clock
        self._ttl = ttl_s
        self._max = max_conversations
        self._max_bytes = max_bytes
        self._data: OrderedDict[ConversationId, tuple[Conversation, float, int]] = OrderedDict()
        self._bytes = 0
        self._responses: OrderedDict[str, ConversationId] = OrderedDict()
        self.corruption = Corruption()

    def _live(self, cid: ConversationId) -> Conversation | None:
        item = self._data.get(cid)
        if item is None:
            return None
        if item[1] <= self._clock.now():
            self._drop(cid)
            return None
        return item[0]

    async def get(self, cid: ConversationId) -> Conversation | None:
        c = self._live(cid)
        if c is not None:
            self._put(c)
        return c

    async def peek(self, cid: ConversationId) -> Conversation | None:
        return self._live(cid)

    async def update(self, cid: ConversationId, fn: Updater, known: Conversation | None = UNREAD
                     ) -> Conversation | None:
        # One event loop and no await between the read and the write: atomic as it stands.
        cur = self._live(cid)
        new = fn(cur)
        if new is None:
            return cur
        new = replace(new, version=(cur.version if cur else 0) + 1)
        self._put(new)
        for rid in new.responses:
            if rid not in self._responses:
                self._responses[rid] = cid
        while len(self._responses) > self._max:
            self._responses.popitem(last=False)
        return new

    async def delete(self, cid: ConversationId) -> bool:
        return self._drop(cid)

    async def conversation_of(self, response_id: str) -> ConversationId | None:
        cid = self._responses.get(response_id)
        return cid if cid is not None and self._live(cid) is not None else None

    def stats(self) -> dict[str, int]:
        return {"conversations": len(self._data), "bytes": self._bytes}

    async def close(self) -> None:
        return None

    def _put(self, c: Conversation) -> None:
        self._drop(c.id)
        size = c.body_bytes() + 512 + 128 * len(c.turns)
        self._data[c.id] = (c, self._clock.now() + self._ttl, size)
        self._bytes += size
        while self._data and (len(self._data) > self._max or self._bytes > self._max_bytes):
            self._drop(next(iter(self._data)))

    def _drop(self, cid: ConversationId) -> bool:
        item = self._data.pop(cid, None)
        if item is None:
            return False
        self._bytes -= item[2]
        return True
