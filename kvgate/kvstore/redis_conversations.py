"""Conversation records in Redis (one instance or a Redis Cluster), shared by every gateway replica.

Keys of one conversation share a hash tag, so a cluster keeps them in one slot and one Lua script can
write them together::

    {prefix}{<cid>}:h   hash: ver (the compare-and-set version), data (the head, ``kvstore/codec.py``)
    {prefix}{<cid>}:b   string: the body (history, exact replies, chain), rewritten when a turn completes
    {prefix}r:<rid>     string: the conversation a response id belongs to (another slot: a separate write)

Both record keys expire together (``ttl_s``, refreshed by ``get``). A write is a Lua compare-and-set on
``ver``: a replica that read version v writes only if the record is still at v, else it re-reads and
re-applies its change. The body is sent only when its generation changed, and a replica keeps the
bodies it read (LRU) so that a conversation that stays on it reads only the head.

Costs per request (measured figures in the closing note of issue 10): one round trip to read (two when
the body changed since this replica last read it), one to write, plus the response-id write.
"""

from __future__ import annotations

import asyncio
import random
from collections import OrderedDict
from dataclasses import replace
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisError

from kvgate.kvstore.codec import CodecError, decode, encode_body, encode_head, with_body
from kvgate.kvstore.conversations import UNREAD, StoreError, Updater
from kvgate.router.types import ConversationId
from kvgate.session.conversation import Conversation

_CAS = """
local v = redis.call('HGET', KEYS[1], 'ver')
if (v or '0') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'ver', ARGV[2], 'data', ARGV[3])
redis.call('PEXPIRE', KEYS[1], ARGV[5])
if ARGV[4] ~= '' then
  redis.call('SET', KEYS[2], ARGV[4], 'PX', ARGV[5])
else
  redis.call('PEXPIRE', KEYS[2], ARGV[5])
end
return 1
"""

Client = aioredis.Redis | RedisCluster


def connect(url: str, cluster: bool, timeout_s: float) -> Client:
    """A client with bounded waits: a Redis that hangs (a partition, not a refusal) must fail fast so the
    request is served without conversation state instead of hanging with it."""
    if cluster:
        return RedisCluster.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
    return aioredis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)


class RedisConversationStore:
    def __init__(self, url: str, ttl_s: float = 3600.0, prefix: str = "kvgate:", *, cluster: bool = False,
                 timeout_s: float = 0.5, max_retries: int = 16, cached_bodies: int = 10_000) -> None:
        self._r = connect(url, cluster, timeout_s)
        self._ttl_ms = int(ttl_s * 1000)
        self._prefix = prefix
        self._cas = self._r.register_script(_CAS)
        self._retries = max_retries
        self._max_cached = cached_bodies
        self._bodies: OrderedDict[ConversationId, Conversation] = OrderedDict()
        """The last record this replica read or wrote with its body, by conversation (LRU): its body is
        reused while the body generation in Redis is the same."""
        self.round_trips = 0
        self.bytes_read = 0
        self.bytes_written = 0

    def _keys(self, cid: ConversationId) -> tuple[str, str]:
        tag = f"{self._prefix}{{{cid}}}"
        return f"{tag}:h", f"{tag}:b"

    async def _call(self, aw: Any) -> Any:
        self.round_trips += 1
        try:
            return await aw
        except RedisError as exc:
            raise StoreError(f"conversation store unavailable: {exc!r}") from exc

    async def _read(self, cid: ConversationId, refresh: bool) -> tuple[int, Conversation] | None:
        head_key, body_key = self._keys(cid)
        cached = self._bodies.get(cid)
        async with self._r.pipeline(transaction=False) as p:
            p.hmget(head_key, ["ver", "data"])
            if cached is None:
                p.get(body_key)
            if refresh:
                p.pexpire(head_key, self._ttl_ms)
                p.pexpire(body_key, self._ttl_ms)
            res = await self._call(p.execute())
        ver, head = res[0]
        if head is None:
            self._bodies.pop(cid, None)
            return None
        try:
            conv = decode(head, None)
            self.bytes_read += len(head)
            if cached is not None and cached.body_gen == conv.body_gen:
                # Decoded once: the chain keeps the block hashes this replica already computed.
                return int(ver or 0), with_body(conv, cached)
            body = res[1] if cached is None else await self._call(self._r.get(body_key))
            if body is None:
                return int(ver or 0), conv
            self.bytes_read += len(body)
            full = decode(head, body)
            self._remember(full)
            return int(ver or 0), full
        except CodecError as exc:
            # A corrupt value, or one this version cannot read at all (a newer one is read by name).
            raise StoreError(f"conversation {cid}: unreadable record ({exc})") from exc

    def _remember(self, conv: Conversation) -> None:
        self._bodies[conv.id] = conv
        self._bodies.move_to_end(conv.id)
        while len(self._bodies) > self._max_cached:
            self._bodies.popitem(last=False)

    async def get(self, cid: ConversationId) -> Conversation | None:
        got = await self._read(cid, refresh=True)
        return None if got is None else got[1]

    async def peek(self, cid: ConversationId) -> Conversation | None:
        got = await self._read(cid, refresh=False)
        return None if got is None else got[1]

    async def update(self, cid: ConversationId, fn: Updater, known: Conversation | None = UNREAD
                     ) -> Conversation | None:
        head_key, body_key = self._keys(cid)
        for attempt in range(self._retries):
            if attempt:
                # Another writer got there first: back off a random while, so that many writers of one
                # conversation do not all collide again on the next try.
                await asyncio.sleep(random.uniform(0, 0.001 * 2 ** min(attempt, 6)))
            if attempt == 0 and known is not UNREAD:
                cur = known
                ver = cur.version if cur is not None else 0
            else:
                got = await self._read(cid, refresh=False)
                ver, cur = got if got is not None else (0, None)
            new = fn(cur)
            if new is None:
                return cur
            new = replace(new, version=ver + 1)
            head = encode_head(new)
            body = encode_body(new) if cur is None or new.body_gen != cur.body_gen else b""
            ok = await self._call(self._cas(keys=[head_key, body_key],
                                            args=[str(ver), str(ver + 1), head, body, self._ttl_ms]))
            if ok == 1:
                self.bytes_written += len(head) + len(body)
                self._remember(new)
                await self._index_responses(cur, new)
                return new
        raise StoreError(f"conversation {cid}: {self._retries} concurrent writers in a row; gave up")

    async def _index_responses(self, cur: Conversation | None, new: Conversation) -> None:
        fresh = [r for r in new.responses if cur is None or r not in cur.responses]
        if not fresh:
            return
        async with self._r.pipeline(transaction=False) as p:
            for rid in fresh:
                p.set(f"{self._prefix}r:{rid}", new.id, px=self._ttl_ms)
            await self._call(p.execute())

    async def delete(self, cid: ConversationId) -> bool:
        self._bodies.pop(cid, None)
        head_key, body_key = self._keys(cid)
        return bool(await self._call(self._r.delete(head_key, body_key)))

    async def conversation_of(self, response_id: str) -> ConversationId | None:
        cid = await self._call(self._r.get(f"{self._prefix}r:{response_id}"))
        return None if cid is None else ConversationId(cid.decode() if isinstance(cid, bytes) else str(cid))

    def stats(self) -> dict[str, int]:
        return {"cached_bodies": len(self._bodies), "round_trips": self.round_trips, "bytes_read": self.bytes_read,
                "bytes_written": self.bytes_written}

    async def close(self) -> None:
        await self._r.aclose()
