"""Sessions in Redis, shared by every gateway replica.

Each conversation is one JSON value under ``{prefix}{id}`` with a TTL (``SET PX``). Writes go through a
Lua compare-and-set on the session's ``version``: a gateway that read version v may write only if the
stored value is still at v, otherwise it re-reads and re-applies its change. Two gateways appending to
the same conversation therefore never lose each other's turns. ``get`` refreshes the TTL, ``peek``
does not. Memory stays bounded by the TTL and the per-session cap on kept turns.
"""

from __future__ import annotations

import json
from dataclasses import replace

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from kvgate.kvstore.sessions import Session, Updater
from kvgate.router.types import ConversationId

_CAS = """
local cur = redis.call('GET', KEYS[1])
local v = 0
if cur then v = cjson.decode(cur)['version'] end
if tonumber(v) ~= tonumber(ARGV[1]) then return 0 end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
return 1
"""


class SessionStoreError(RuntimeError):
    """Redis did not answer; the gateway serves the request without session state."""


class RedisSessionStore:
    def __init__(self, url: str, ttl_s: float = 3600.0, prefix: str = "kvgate:session:",
                 max_retries: int = 16, timeout_s: float = 0.5) -> None:
        # Bounded waits: a Redis that hangs (a partition, not a refusal) must fail fast so the request
        # is served without session state instead of hanging with it.
        self._r = aioredis.from_url(url, decode_responses=True, socket_timeout=timeout_s,
                                    socket_connect_timeout=timeout_s)
        self._ttl_ms = int(ttl_s * 1000)
        self._prefix = prefix
        self._cas = self._r.register_script(_CAS)
        self._retries = max_retries

    def _key(self, cid: ConversationId) -> str:
        return self._prefix + cid

    async def _read(self, cid: ConversationId, refresh: bool) -> Session | None:
        try:
            raw = await (self._r.getex(self._key(cid), px=self._ttl_ms) if refresh else self._r.get(self._key(cid)))
        except RedisError as exc:
            raise SessionStoreError(f"session store unavailable: {exc}") from exc
        if not raw:
            return None
        try:
            return Session.from_json(json.loads(raw))
        except (ValueError, TypeError, KeyError) as exc:
            # A corrupt value, or one written by a newer replica with fields this one does not know.
            raise SessionStoreError(f"conversation {cid}: unreadable session ({exc!r})") from exc

    async def get(self, cid: ConversationId) -> Session | None:
        return await self._read(cid, refresh=True)

    async def peek(self, cid: ConversationId) -> Session | None:
        return await self._read(cid, refresh=False)

    async def update(self, cid: ConversationId, fn: Updater) -> Session:
        for _ in range(self._retries):
            cur = await self.peek(cid)
            base = cur.version if cur else 0
            new = replace(fn(cur), version=base + 1)
            try:
                ok = await self._cas(keys=[self._key(cid)], args=[base, json.dumps(new.to_json()), self._ttl_ms])
            except RedisError as exc:
                raise SessionStoreError(f"session store unavailable: {exc}") from exc
            if ok == 1:
                return new
        raise SessionStoreError(f"conversation {cid}: {self._retries} concurrent writers in a row; gave up")

    async def put(self, session: Session) -> None:
        try:
            await self._r.set(self._key(session.conversation_id), json.dumps(session.to_json()), px=self._ttl_ms)
        except RedisError as exc:
            raise SessionStoreError(f"session store unavailable: {exc}") from exc

    async def delete(self, cid: ConversationId) -> bool:
        try:
            return bool(await self._r.delete(self._key(cid)))
        except RedisError as exc:
            raise SessionStoreError(f"session store unavailable: {exc}") from exc

    async def count(self) -> int:
        """Sessions held (a SCAN: meant for the metrics scrape, not for the request path)."""
        n = 0
        try:
            async for _ in self._r.scan_iter(match=self._prefix + "*", count=1000):
                n += 1
        except RedisError as exc:
            raise SessionStoreError(f"session store unavailable: {exc}") from exc
        return n

    async def close(self) -> None:
        await self._r.aclose()
