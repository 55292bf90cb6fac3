"""The fleet's run-time policy parameters, versioned, shared by every replica (``gateway/policysync.py``).

One document: every section as it is now (``cost``, ``waits``, ``prefill``), its version and who made it::

    {prefix}policy   hash: ver (the version, compare-and-set), data (the document, JSON)

A write is a compare-and-set on ``ver`` as the writer read it (the raw bytes, so a corrupt entry can be
replaced by one who read it corrupt). A document that does not parse is read as absent and counted: the
next edit replaces it, and until then each replica keeps the parameters it has.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any, Protocol

from redis.exceptions import RedisError

from kvgate.kvstore.conversations import StoreError
from kvgate.kvstore.redis_conversations import Client, connect

log = logging.getLogger("kvgate.policy")

MAX_DOC_BYTES = 256 * 1024
"""A policy document is a few KiB (the tool-wait priors are its largest part, bounded by the edit's checks)."""


@dataclass(frozen=True, slots=True)
class PolicyDoc:
    version: int
    sections: dict[str, dict[str, Any]]
    who: str = ""
    via: str = ""
    reason: str = ""
    at: float = 0.0

    def encode(self) -> bytes:
        return json.dumps({"version": self.version, "sections": self.sections, "who": self.who, "via": self.via,
                           "reason": self.reason, "at": self.at}).encode()


def decode(raw: bytes) -> PolicyDoc | None:
    """The document, or None when it is not one this kvgate wrote."""
    if len(raw) > MAX_DOC_BYTES:
        return None
    try:
        d = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(d, dict) or not isinstance(d.get("version"), int) or isinstance(d["version"], bool) \
            or not isinstance(d.get("sections"), dict) \
            or not all(isinstance(k, str) and isinstance(v, dict) for k, v in d["sections"].items()):
        return None
    def text(k: str) -> str:
        v = d.get(k)
        return v if isinstance(v, str) else ""

    at = d.get("at")
    when = float(at) if isinstance(at, int | float) and not isinstance(at, bool) else 0.0
    return PolicyDoc(d["version"], d["sections"], text("who"), text("via"), text("reason"), when)


@dataclass(frozen=True, slots=True)
class Read:
    token: bytes
    """What a write must find to replace it (``b""``: nothing there)."""
    doc: PolicyDoc | None
    """None: nothing there, or what is there is corrupt (``corrupt``)."""
    corrupt: bool = False


class PolicyStore(Protocol):
    async def read(self) -> Read: ...

    async def write(self, token: bytes, doc: PolicyDoc) -> bool:
        """Replace what ``token`` was read as with ``doc``; False when another write came first."""
        ...

    async def close(self) -> None: ...


class MemoryPolicyStore:
    """One process's (the memory session store): the same versions, nobody else to share them with."""

    def __init__(self) -> None:
        self._doc: PolicyDoc | None = None

    async def read(self) -> Read:
        return Read(str(self._doc.version).encode() if self._doc else b"", self._doc)

    async def write(self, token: bytes, doc: PolicyDoc) -> bool:
        if (await self.read()).token != token:
            return False
        self._doc = doc
        return True

    async def close(self) -> None:
        return None


_CAS = """
local t = redis.call('TYPE', KEYS[1])['ok']
local v = ''
if t == 'hash' then
  v = redis.call('HGET', KEYS[1], 'ver') or ''
elseif t ~= 'none' then
  v = 'type:' .. t
end
if v ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'ver', ARGV[2], 'data', ARGV[3])
return 1
"""


class RedisPolicyStore:
    def __init__(self, url: str, prefix: str = "kvgate:", *, cluster: bool = False, timeout_s: float = 0.5) -> None:
        self._r: Client = connect(url, cluster, timeout_s)
        self._key = f"{prefix}policy"
        self._cas: Any = self._r.register_script(_CAS)

    async def read(self) -> Read:
        try:
            kind = await self._r.type(self._key)
            if kind in (b"none", "none"):
                return Read(b"", None)
            if kind not in (b"hash", "hash"):
                return Read(b"type:" + (kind if isinstance(kind, bytes) else str(kind).encode()), None, corrupt=True)
            ver, data = await self._r.hmget(self._key, ["ver", "data"])
        except RedisError as exc:
            raise StoreError(f"policy store: {exc}") from exc
        token = ver if isinstance(ver, bytes) else b""
        doc = decode(data) if isinstance(data, bytes) else None
        if doc is None or token != str(doc.version).encode():
            return Read(token, None, corrupt=True)
        return Read(token, doc)

    async def write(self, token: bytes, doc: PolicyDoc) -> bool:
        try:
            return bool(await self._cas(keys=[self._key], args=[token, str(doc.version), doc.encode()]))
        except RedisError as exc:
            raise StoreError(f"policy store: {exc}") from exc

    async def close(self) -> None:
        await self._r.aclose()
