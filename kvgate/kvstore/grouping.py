"""Where keyless conversations' message digests are filed (``session/regroup.py`` says which and why).

In memory (one replica) or in Redis, shared by the replicas like the conversations themselves::

    {prefix}g:{<tenant>}:<digest>   string: the conversation the digest was last filed under (TTL)

A tenant's keys share a hash tag, so a cluster answers one request's lookups with one MGET. Entries are
scoped by tenant: one tenant's messages never find another tenant's conversation. Errors are not the
request's: a lookup that fails finds nothing (the derived key is used), a write that fails is lost.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

from redis.exceptions import RedisError

from kvgate.kvstore.redis_conversations import Client, connect
from kvgate.router.types import ConversationId

log = logging.getLogger("kvgate.grouping")


class GroupingIndex(Protocol):
    async def lookup(self, tenant: str, digests: Sequence[str]) -> list[ConversationId | None]: ...

    async def add(self, tenant: str, digests: Sequence[str], cid: ConversationId) -> None: ...

    async def close(self) -> None: ...


ENTRY_BYTES = 160
"""What one entry holds in memory (key and value strings, the dict slot): the byte bound's unit."""


class MemoryGroupingIndex:
    """One replica's index, least recently filed out first, bounded in bytes."""

    def __init__(self, max_bytes: int = 16 << 20) -> None:
        self._max = max(1, max_bytes // ENTRY_BYTES)
        self._entries: OrderedDict[tuple[str, str], ConversationId] = OrderedDict()

    async def lookup(self, tenant: str, digests: Sequence[str]) -> list[ConversationId | None]:
        return [self._entries.get((tenant, d)) for d in digests]

    async def add(self, tenant: str, digests: Sequence[str], cid: ConversationId) -> None:
        for d in digests:
            self._entries[(tenant, d)] = cid
            self._entries.move_to_end((tenant, d))
        while len(self._entries) > self._max:
            self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)

    async def close(self) -> None:
        return None


class RedisGroupingIndex:
    def __init__(self, url: str, ttl_s: float, prefix: str = "kvgate:", *, cluster: bool = False,
                 timeout_s: float = 0.5) -> None:
        self._r: Client = connect(url, cluster, timeout_s)
        self._ttl_ms = max(1, int(ttl_s * 1000))
        self._prefix = prefix

    def _key(self, tenant: str, digest: str) -> str:
        return f"{self._prefix}g:{{{tenant}}}:{digest}"

    async def lookup(self, tenant: str, digests: Sequence[str]) -> list[ConversationId | None]:
        if not digests:
            return []
        try:
            raw = await self._r.mget([self._key(tenant, d) for d in digests])
        except RedisError as exc:
            log.warning("grouping lookup: %s", exc)
            return [None] * len(digests)
        # A value kvgate did not write (wrong type, not UTF-8) finds nothing rather than failing the request.
        return [ConversationId(v.decode()) if isinstance(v, bytes) and v.isascii() else None for v in raw]

    async def add(self, tenant: str, digests: Sequence[str], cid: ConversationId) -> None:
        if not digests:
            return
        try:
            async with self._r.pipeline(transaction=False) as pipe:
                for d in digests:
                    pipe.set(self._key(tenant, d), cid, px=self._ttl_ms)
                await pipe.execute()
        except RedisError as exc:
            log.warning("grouping write: %s", exc)

    async def close(self) -> None:
        await self._r.aclose()
