"""Stored responses for ``GET /v1/responses/{id}`` and ``/input_items``: the response object and its
input items, owned by a tenant, kept for the session TTL, in this process's memory or in Redis (as the
conversations are: ``session_store``), each at most ``max_bytes`` (a larger one is answered but not kept).

Continuing a response (``previous_response_id``) does not need this object: the conversation record
holds the history (gateway/prepare.py). This store only answers retrieval.

Redis keys: ``{prefix}resp:<response id>`` — a JSON string, expiring with the session TTL.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Protocol

from redis.exceptions import RedisError

from kvgate.clock import Clock
from kvgate.kvstore.redis_conversations import connect

log = logging.getLogger(__name__)

MAX_RESPONSE_BYTES = 1 << 20
"""One stored response (object and input items, as JSON): a larger one is answered but not retrievable."""


@dataclass(frozen=True, slots=True)
class Stored:
    tenant: str
    response: dict[str, Any]
    input_items: list[dict[str, Any]]

    def encode(self) -> bytes:
        return json.dumps({"tenant": self.tenant, "response": self.response, "input": self.input_items}).encode()

    @classmethod
    def decode(cls, raw: bytes | str) -> Stored | None:
        try:
            obj = json.loads(raw)
        except (ValueError, RecursionError):
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("tenant"), str) \
                or not isinstance(obj.get("response"), dict) or not isinstance(obj.get("input"), list):
            return None  # corrupt: treated as absent
        return cls(obj["tenant"], obj["response"], obj["input"])


class ResponseStore(Protocol):
    async def put(self, resp_id: str, stored: Stored) -> bool:
        """Keep it (False: over the size limit or the store is down; the response was still answered)."""
        ...

    async def get(self, resp_id: str, tenant: str) -> Stored | None:
        """The stored response if ``tenant`` owns it (another tenant's reads as absent)."""
        ...

    async def delete(self, resp_id: str, tenant: str) -> bool: ...

    async def close(self) -> None: ...


class MemoryResponseStore:
    """One process's responses, least recently stored first out past ``max_total_bytes``, with a TTL."""

    def __init__(self, clock: Clock, ttl_s: float, max_total_bytes: int, max_bytes: int = MAX_RESPONSE_BYTES) -> None:
        self._clock = clock
        self._ttl = ttl_s
        self._max_total = max_total_bytes
        self._max = max_bytes
        self._data: OrderedDict[str, tuple[bytes, float]] = OrderedDict()
        self._bytes = 0

    async def put(self, resp_id: str, stored: Stored) -> bool:
        raw = stored.encode()
        if len(raw) > self._max:
            return False
        self._drop(resp_id)
        self._data[resp_id] = (raw, self._clock.now() + self._ttl)
        self._bytes += len(raw)
        while self._bytes > self._max_total and self._data:
            self._drop(next(iter(self._data)))
        return True

    async def get(self, resp_id: str, tenant: str) -> Stored | None:
        item = self._data.get(resp_id)
        if item is None:
            return None
        if item[1] <= self._clock.now():
            self._drop(resp_id)
            return None
        s = Stored.decode(item[0])
        return s if s is not None and s.tenant == tenant else None

    async def delete(self, resp_id: str, tenant: str) -> bool:
        if await self.get(resp_id, tenant) is None:
            return False
        self._drop(resp_id)
        return True

    def _drop(self, resp_id: str) -> None:
        item = self._data.pop(resp_id, None)
        if item is not None:
            self._bytes -= len(item[0])

    async def close(self) -> None:
        self._data.clear()


class RedisResponseStore:
    def __init__(self, url: str, ttl_s: float, prefix: str, *, cluster: bool = False, timeout_s: float = 0.5,
                 max_bytes: int = MAX_RESPONSE_BYTES) -> None:
        self._r = connect(url, cluster, timeout_s)
        self._ttl_ms = int(ttl_s * 1000)
        self._prefix = prefix
        self._max = max_bytes

    def _key(self, resp_id: str) -> str:
        return f"{self._prefix}resp:{resp_id}"

    async def put(self, resp_id: str, stored: Stored) -> bool:
        raw = stored.encode()
        if len(raw) > self._max:
            return False
        try:
            await self._r.set(self._key(resp_id), raw, px=self._ttl_ms)
        except RedisError as exc:
            log.warning("response %s not stored: %s", resp_id, exc)
            return False
        return True

    async def get(self, resp_id: str, tenant: str) -> Stored | None:
        try:
            raw = await self._r.get(self._key(resp_id))
        except RedisError as exc:
            # Another type under the key (corrupt) or Redis down: the response cannot be read, as absent.
            log.warning("response %s not read: %s", resp_id, exc)
            return None
        s = Stored.decode(raw) if isinstance(raw, bytes | str) else None
        return s if s is not None and s.tenant == tenant else None

    async def delete(self, resp_id: str, tenant: str) -> bool:
        if await self.get(resp_id, tenant) is None:
            return False
        try:
            return bool(await self._r.delete(self._key(resp_id)))
        except RedisError as exc:
            log.warning("response %s not deleted: %s", resp_id, exc)
            return False

    async def close(self) -> None:
        await self._r.aclose()
