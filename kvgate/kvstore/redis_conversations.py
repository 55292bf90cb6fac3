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
from dataclasses import dataclass, replace
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisError, ResponseError

from kvgate.kvstore.codec import CodecError, decode, encode_body, encode_head, with_body
from kvgate.kvstore.conversations import UNREAD, Memo, StoreError, Updater, record_bytes
from kvgate.kvstore.corrupt import Corruption
from kvgate.router.types import ConversationId
from kvgate.session.conversation import Conversation

_CAS = """
local t = redis.call('TYPE', KEYS[1])['ok']
local v = '0'
if t == 'hash' then
  v = redis.call('HGET', KEYS[1], 'ver') or '0'
elseif t ~= 'none' then
  v = 'type:' .. t
end
if v ~= ARGV[1] then return 0 end
if ARGV[6] == '1' then redis.call('DEL', KEYS[1], KEYS[2]) end
redis.call('HSET', KEYS[1], 'ver', ARGV[2], 'data', ARGV[3])
redis.call('PEXPIRE', KEYS[1], ARGV[5])
if ARGV[4] ~= '' then
  redis.call('SET', KEYS[2], ARGV[4], 'PX', ARGV[5])
else
  redis.call('PEXPIRE', KEYS[2], ARGV[5])
end
return 1
"""
"""The compare-and-set. ``ARGV[1]`` is ``ver`` as the writer read it — the raw bytes, or ``type:<t>``
when the key held another Redis type — so a writer replacing a corrupt record replaces only the value
it found corrupt; ``ARGV[6]`` = 1 then clears both keys first (stray hash fields, a body of the wrong
type)."""

Client = aioredis.Redis | RedisCluster


def connect(url: str, cluster: bool, timeout_s: float) -> Client:
    """A client with bounded waits: a Redis that hangs (a partition, not a refusal) must fail fast so the
    request is served without conversation state instead of hanging with it."""
    if cluster:
        return RedisCluster.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
    return aioredis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)


class WrongType(StoreError):
    """A key kvgate owns holds another Redis type (WRONGTYPE): corrupt, not unavailable."""


def is_wrong_type(exc: BaseException) -> bool:
    return isinstance(exc, ResponseError) and str(exc).startswith("WRONGTYPE")


@dataclass(frozen=True, slots=True)
class _Read:
    token: bytes
    """``ver`` as stored (the compare-and-set's expected value): ``b"0"`` when there is no record."""
    conv: Conversation | None
    corrupt: str = ""
    """Why the stored record cannot be read; ``conv`` is then None and the next write replaces it."""

    @property
    def version(self) -> int:
        return _version(self.token) or 0


def _version(raw: bytes | None) -> int | None:
    try:
        v = int(raw or b"0")
    except ValueError:
        return None
    return v if v >= 0 else None


class RedisConversationStore:
    def __init__(self, url: str, ttl_s: float = 3600.0, prefix: str = "kvgate:", *, cluster: bool = False,
                 timeout_s: float = 0.5, max_retries: int = 16, cached_bodies: int = 10_000,
                 cached_bytes: int = 256 << 20) -> None:
        self._r = connect(url, cluster, timeout_s)
        self._ttl_ms = int(ttl_s * 1000)
        self._prefix = prefix
        self._cas = self._r.register_script(_CAS)
        self._retries = max_retries
        self._max_cached = cached_bodies
        self._bodies: OrderedDict[ConversationId, tuple[Conversation, int, Memo]] = OrderedDict()
        """The last record this replica read or wrote with its body and the bytes it holds, by
        conversation (LRU, bounded by count and by bytes): its body is reused while the body generation
        in Redis is the same."""
        self._max_cached_bytes = cached_bytes
        self._cached_bytes = 0
        self.corruption = Corruption()
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
            if is_wrong_type(exc):
                raise WrongType(str(exc)) from exc
            raise StoreError(f"conversation store unavailable: {exc!r}") from exc

    async def _read(self, cid: ConversationId, refresh: bool) -> _Read:
        head_key, body_key = self._keys(cid)
        entry = self._bodies.get(cid)
        cached = entry[0] if entry is not None else None
        async with self._r.pipeline(transaction=False) as p:
            p.hmget(head_key, ["ver", "data"])
            if cached is None:
                p.get(body_key)
            if refresh:
                p.pexpire(head_key, self._ttl_ms)
                p.pexpire(body_key, self._ttl_ms)
            res = await self._call(p.execute(raise_on_error=False))
        for r in res:
            if isinstance(r, Exception) and not is_wrong_type(r):
                raise StoreError(f"conversation store unavailable: {r!r}")
        if isinstance(res[0], Exception):
            kind = await self._call(self._r.type(head_key))
            return self._corrupt(cid, b"type:" + (kind if isinstance(kind, bytes) else str(kind).encode()),
                                 "the head key holds another Redis type")
        ver, head = res[0]
        if head is None:
            self._forget(cid)
            return _Read(b"0", None) if ver is None else self._corrupt(cid, ver, "a head without data")
        if _version(ver) is None:
            return self._corrupt(cid, ver, "its version is not a number")
        try:
            conv = decode(head, None)
            if conv.id != cid:
                raise CodecError(f"the record of another conversation ({conv.id[:100]!r})")
            conv = replace(conv, version=_version(ver) or 0)
            self.bytes_read += len(head)
            # The creation time tells a record that started again (expired, or reset from corrupt: its
            # generations count from 0 again) from the one whose body this replica holds.
            if cached is not None and (cached.body_gen, cached.created) == (conv.body_gen, conv.created):
                # Decoded once: the chain keeps the block hashes this replica already computed.
                return _Read(ver or b"0", with_body(conv, cached))
            body = res[1] if cached is None else await self._call(self._r.get(body_key))
            if isinstance(body, Exception):
                raise CodecError("the body key holds another Redis type")
            if body is None:
                return _Read(ver or b"0", conv)
            self.bytes_read += len(body)
            full = replace(decode(head, body), version=conv.version)
            self._remember(full)
            return _Read(ver or b"0", full)
        except (CodecError, WrongType) as exc:
            # A corrupt value, or one this version cannot read at all (a newer one is read by name).
            return self._corrupt(cid, ver or b"0", str(exc))

    def _corrupt(self, cid: ConversationId, token: bytes, reason: str) -> _Read:
        self._forget(cid)
        self.corruption.found("conversation", cid, reason)
        return _Read(token, None, reason)

    def _remember(self, conv: Conversation) -> None:
        prev = self._bodies.get(conv.id)
        self._forget(conv.id)
        # A record written here is built on the one cached: only what the turn added is measured.
        size, memo = record_bytes(conv, prev[2] if prev is not None else None)
        self._bodies[conv.id] = (conv, size, memo)
        self._cached_bytes += size
        while self._bodies and (len(self._bodies) > self._max_cached or self._cached_bytes > self._max_cached_bytes):
            self._forget(next(iter(self._bodies)))

    def _forget(self, cid: ConversationId) -> None:
        entry = self._bodies.pop(cid, None)
        if entry is not None:
            self._cached_bytes -= entry[1]

    async def get(self, cid: ConversationId) -> Conversation | None:
        """The record; None when there is none or it is corrupt (the request is then served as a new
        conversation's, and its turn writes a fresh record in place of the corrupt one)."""
        return (await self._read(cid, refresh=True)).conv

    async def peek(self, cid: ConversationId) -> Conversation | None:
        """As ``get``, but a corrupt record is shown as an empty one that says why it will be reset."""
        got = await self._read(cid, refresh=False)
        return Conversation(cid, reset=got.corrupt) if got.corrupt else got.conv

    async def update(self, cid: ConversationId, fn: Updater, known: Conversation | None = UNREAD
                     ) -> Conversation | None:
        head_key, body_key = self._keys(cid)
        for attempt in range(self._retries):
            if attempt:
                # Another writer got there first: back off a random while, so that many writers of one
                # conversation do not all collide again on the next try.
                await asyncio.sleep(random.uniform(0, 0.001 * 2 ** min(attempt, 6)))
            if attempt == 0 and known is not UNREAD:
                got = _Read(str(known.version if known is not None else 0).encode(), known)
            else:
                got = await self._read(cid, refresh=False)
            cur = got.conv
            new = fn(cur)
            if new is None:
                return cur
            ver = got.version
            new = replace(new, version=ver + 1, reset=got.corrupt or new.reset)
            head = encode_head(new)
            body = encode_body(new) if cur is None or new.body_gen != cur.body_gen else b""
            ok = await self._call(self._cas(keys=[head_key, body_key], args=[
                got.token, str(ver + 1), head, body, self._ttl_ms, "1" if got.corrupt else "0"]))
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
        self._forget(cid)
        head_key, body_key = self._keys(cid)
        return bool(await self._call(self._r.delete(head_key, body_key)))

    async def conversation_of(self, response_id: str) -> ConversationId | None:
        key = f"{self._prefix}r:{response_id}"
        try:
            cid = await self._call(self._r.get(key))
            if cid is None:
                return None
            return ConversationId(cid.decode() if isinstance(cid, bytes) else str(cid))
        except (WrongType, UnicodeDecodeError) as exc:
            # Not a conversation id: the response is unknown, and the key goes (it would never heal).
            self.corruption.found("response_id", key, str(exc))
            await self._call(self._r.delete(key))
            return None

    def stats(self) -> dict[str, int]:
        return {"cached_bodies": len(self._bodies), "cached_bytes": self._cached_bytes,
                "round_trips": self.round_trips, "bytes_read": self.bytes_read,
                "bytes_written": self.bytes_written}

    async def close(self) -> None:
        await self._r.aclose()
