"""Conversation records behind one small async interface: in this process's memory, or in Redis so that
every gateway replica reads and writes the same records (``kvstore/redis_conversations.py``).

``get`` refreshes a record's expiry (it is in use); ``peek`` does not (observers, admin). ``update`` is a
read-modify-write that never loses a concurrent writer's change: the function is re-applied to the
newer record when another writer (another request, another replica) got there first. It returns the
record written, or the current one when the function declines to write (returns None).
"""

from __future__ import annotations

import enum
import functools
import sys
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import fields, is_dataclass, replace
from typing import Any, Protocol

from kvgate.clock import Clock
from kvgate.kvstore.corrupt import Corruption
from kvgate.router.types import ConversationId
from kvgate.session.conversation import Chain, Conversation

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
    """One process's records, bounded by count and by the bytes they hold (least recently used first),
    with a TTL."""

    def __init__(self, clock: Clock, ttl_s: float = 3600.0, max_conversations: int = 100_000,
                 max_bytes: int = 1 << 30) -> None:
        self._clock = clock
        self._ttl = ttl_s
        self._max = max_conversations
        self._max_bytes = max_bytes
        self._data: OrderedDict[ConversationId, tuple[Conversation, float, int, tuple[int, ...], Memo]] = \
            OrderedDict()
        """(record, expiry, bytes held, its block hashes' lengths when measured, its parts' sizes) by
        conversation, LRU first."""
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
        item = self._data.get(c.id)
        self._drop(c.id)
        # The chain's block hashes are filled in after the record is stored (when the next turn is
        # routed), and they are much of what a long record holds: a record read again is measured again
        # when they changed.
        sig = _hashes_sig(c)
        if item is not None and item[0] is c and item[3] == sig:
            size, memo = item[2], item[4]
        else:
            held, memo = record_bytes(c, item[4] if item is not None else None)
            size = held + _ENTRY_BYTES + _INDEX_BYTES * len(c.responses)
        self._data[c.id] = (c, self._clock.now() + self._ttl, size, sig, memo)
        self._bytes += size
        for rid in c.responses:  # _drop took the old entry's ids out of the index; a read must not lose them
            self._responses.setdefault(rid, c.id)
        while self._data and (len(self._data) > self._max or self._bytes > self._max_bytes):
            self._drop(next(iter(self._data)))

    def _drop(self, cid: ConversationId) -> bool:
        item = self._data.pop(cid, None)
        if item is None:
            return False
        self._bytes -= item[2]
        for rid in item[0].responses:
            # The response index holds what the store holds: a dropped record's ids go with it (they
            # were counted in its size), or the index would keep 100,000 of them past the byte bound.
            if self._responses.get(rid) == cid:
                del self._responses[rid]
        return True


def _hashes_sig(c: Conversation) -> tuple[int, ...]:
    return () if c.chain is None else tuple(len(v[1]) for v in c.chain.hashes.values())


Memo = dict[int, tuple[Any, int, tuple[int, ...]]]
"""A record's parts as last measured, by id: (the part, held so that its id cannot be reused while the
entry stands; its bytes; for a chain, its block hashes' lengths then)."""

_ENTRY_BYTES = 200
"""A record's entry in the store: the LRU's node and key, the (record, expiry, size) tuple."""
_INDEX_BYTES = 100
"""A response id's entry in the response index (the id and the conversation id are the record's)."""
_SHARED = (type(None), bool, enum.Enum)


def held_bytes(obj: Any) -> int:
    """The bytes ``obj`` keeps alive: every object reachable from it (``sys.getsizeof``), an object it
    reaches twice counted once. An estimate from string lengths undercounts a record several times
    over (a str's header, a dict per message, a bytes object and an int per block hash): the byte bound
    would then bound a fraction of what the store holds."""
    seen: set[int] = set()
    stack = [obj]
    total = 0
    while stack:
        o = stack.pop()
        if id(o) in seen or isinstance(o, _SHARED):
            continue
        seen.add(id(o))
        total += sys.getsizeof(o)
        if isinstance(o, dict):
            stack.extend(o.keys())
            stack.extend(o.values())
        elif isinstance(o, list | tuple | set | frozenset):
            stack.extend(o)
        elif is_dataclass(o) and not isinstance(o, type):
            cls: type = type(o)
            stack.extend(getattr(o, name) for name in _slots(cls))
    return total


_ITEMS = frozenset({"history", "exact", "turns", "responses"})
"""A record's tuples whose items a new version shares with the one before (the exact replies, the turn
records, the response ids: a turn appends to them)."""
_LEAVES = (str, bytes, int, float)
_FIELDS = tuple(f.name for f in fields(Conversation))
_MEMO_ENTRY_BYTES = 160
"""One part's memo entry: its slot in the dict, the key (an id: a large int), the (part, size, sig) tuple."""


def record_bytes(c: Conversation, memo: Memo | None = None) -> tuple[int, Memo]:
    """The bytes ``c`` keeps alive, and the memo for measuring its next version. Measured part by part
    (each item of its tuples, its chain, each other field): a part that the previous version, measured
    with ``memo``, already held is not walked again, so a write costs what the turn added, not the whole
    history (a walk of a 40-turn record was a fifth of the gateway's CPU). An object two parts reach is
    counted in each (an upper bound on ``held_bytes``: the keys a JSON document shares between its
    messages, the worker ids its turn records share; ~14% on a 40-turn agent record), except a part that
    is itself in two places (the reply in ``history`` and ``exact``). The memo's own entries count too:
    the bound covers what the store holds to measure."""
    old = memo or {}
    new: Memo = {}
    total = sys.getsizeof(c)
    for name in _FIELDS:
        v = getattr(c, name)
        if name in _ITEMS:
            total += sys.getsizeof(v)
            for item in v:
                total += _part(item, old, new)
        elif name == "chain" and v is not None:
            total += _chain(v, old, new)
        else:
            total += _part(v, old, new)
    return total + sys.getsizeof(new) + _MEMO_ENTRY_BYTES * len(new), new


def _part(o: Any, old: Memo, new: Memo) -> int:
    if isinstance(o, _SHARED):
        return 0
    if isinstance(o, _LEAVES):  # measured in O(1); a memo entry would hold more than the object
        return sys.getsizeof(o)
    k = id(o)
    if k in new:  # this record reaches it twice: counted once
        return 0
    hit = old.get(k)
    size = hit[1] if hit is not None and hit[0] is o else held_bytes(o)
    new[k] = (o, size, ())
    return size


def _chain(ch: Chain, old: Memo, new: Memo) -> int:
    """A chain's bytes: its block hashes summed in C (thousands of bytes objects and ints), measured again
    only when it is a new chain or routing added hashes to it."""
    k, sig = id(ch), tuple(len(v[1]) for v in ch.hashes.values())
    hit = old.get(k)
    if hit is not None and hit[0] is ch and hit[2] == sig:
        new[k] = hit
        return hit[1]
    size = sys.getsizeof(ch) + sum(map(sys.getsizeof, (ch.text, ch.tokens, ch.anchor_chars, ch.anchor_tokens)))
    if ch.engine is not None:
        size += sys.getsizeof(ch.engine)
    size += sys.getsizeof(ch.hashes)
    for key, value in ch.hashes.items():
        _, digests, ints = value
        size += held_bytes(key) + sys.getsizeof(value) + sys.getsizeof(digests) + sys.getsizeof(ints)
        size += sum(map(sys.getsizeof, digests)) + sum(map(sys.getsizeof, ints))
    new[k] = (ch, size, sig)
    return size


@functools.cache
def _slots(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in fields(cls))
