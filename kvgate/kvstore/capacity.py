"""The engines' learned slot caps, shared by the replicas (``admission/slotsync.py``).

A replica learns what each engine runs at once only from polls that catch it saturated
(``admission/capacity.py``); one that joins knows nothing until then and admits without a cap, the
over-admission the cap exists to prevent. So each replica writes the caps it learned, with the wall time
of the reading, and reads the others' before it serves and then on every health round::

    {prefix}slots   hash: <worker id> -> "<cap>|<wall time seen saturated or probed>|<replica id>"

A write replaces an entry only with a newer reading (a script compares the times), so a replica that
learned late cannot put back a cap the fleet has moved past. Bounded: one field per worker, read only
for the workers the reader has (``HMGET``), entries older than the TTL ignored and the key expires
with its newest write. A value kvgate did not write (garbled, a cap out of range, a time in the
future) is dropped, removed and counted (``kvstore/corrupt.py``, kind ``slot_estimate``), and a key of another
Redis type deleted.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from redis.exceptions import RedisError

from kvgate.kvstore.corrupt import Corruption
from kvgate.kvstore.redis_conversations import Client, connect

log = logging.getLogger("kvgate.slots")

MAX_CAP = 1 << 16
"""Requests one engine runs at once (vLLM's ``--max-num-seqs`` defaults to 256-1024); more is not a cap
an engine reported but a value someone else wrote."""
MAX_VALUE_BYTES = 128
SKEW_S = 60.0
"""How far in the future a reading may be (replicas' clocks disagree a little); later ones are corrupt."""

Reading = tuple[int, float]
"""(cap, wall time it was seen saturated or probed)."""
Entry = tuple[int, float, str]
"""A reading and the replica that wrote it."""


def encode(cap: int, at: float, by: str) -> str:
    return f"{cap}|{at:.6f}|{by}"


def parse(value: object, now: float) -> Entry | str:
    """A reading, or why it is not one kvgate wrote."""
    if not isinstance(value, bytes) or len(value) > MAX_VALUE_BYTES:
        return "not a short string"
    try:
        cap_s, at_s, by = value.decode().split("|")
        cap, at = int(cap_s), float(at_s)
    except (UnicodeDecodeError, ValueError):
        return "not <cap>|<time>|<replica>"
    if not 1 <= cap <= MAX_CAP or not by:
        return f"cap {cap_s[:20]} out of range"
    if not math.isfinite(at) or at <= 0 or at > now + SKEW_S:
        return f"time {at_s[:30]} out of range"
    return cap, at, by


class SlotBoard(Protocol):
    ttl_s: float
    """A reading older than this is not used."""

    async def publish(self, readings: Mapping[str, Reading], by: str) -> None:
        """Raises RedisError: the caller counts it (a reading lost costs a joiner its warm start only)."""
        ...

    async def read(self, workers: Sequence[str], now: float) -> dict[str, Entry]:
        """The fleet's newest reading of each of ``workers`` that has one younger than the TTL."""
        ...

    async def close(self) -> None: ...


# Newer wins: an entry kvgate cannot read is replaced (the reader removes it anyway).
_PUBLISH = """
for i = 1, #ARGV - 1, 3 do
  local cur = redis.call('HGET', KEYS[1], ARGV[i])
  local at = cur and tonumber(string.match(cur, '^[^|]*|([^|]*)|'))
  if not at or at < tonumber(ARGV[i + 1]) then
    redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 2])
  end
end
redis.call('PEXPIRE', KEYS[1], ARGV[#ARGV])
return 1
"""

# Removes a corrupt entry only if it is still what was read: a good write since then stays.
_DROP = """
if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then return redis.call('HDEL', KEYS[1], ARGV[1]) end
return 0
"""


class RedisSlotBoard:
    def __init__(self, url: str, prefix: str, ttl_s: float, corruption: Corruption, *, cluster: bool = False,
                 timeout_s: float = 0.5) -> None:
        self._r: Client = connect(url, cluster, timeout_s)
        self.key = f"{prefix}slots"
        self.ttl_s = ttl_s
        self.corruption = corruption
        self._publish: Any = self._r.register_script(_PUBLISH)
        self._drop: Any = self._r.register_script(_DROP)

    async def publish(self, readings: Mapping[str, Reading], by: str) -> None:
        if not readings:
            return
        args: list[str] = []
        for wid, (cap, at) in readings.items():
            args += [wid, f"{at:.6f}", encode(cap, at, by)]
        await self._publish(keys=[self.key], args=[*args, str(max(1000, int(self.ttl_s * 1000)))])

    async def read(self, workers: Sequence[str], now: float) -> dict[str, Entry]:
        if not workers:
            return {}
        try:
            raw = await self._r.hmget(self.key, list(workers))
        except RedisError as exc:
            if "WRONGTYPE" not in str(exc):
                raise
            # Ours by its name, useless as it is, and it would fail every write: gone, the next write heals.
            self.corruption.found("slot_estimate", self.key, "not a hash")
            try:
                await self._r.delete(self.key)
            except RedisError:
                pass
            return {}
        out: dict[str, Entry] = {}
        for wid, value in zip(workers, raw, strict=True):
            if value is None:
                continue
            got = parse(value, now)
            if isinstance(got, str):
                self.corruption.found("slot_estimate", f"{self.key} {wid}", got)
                try:
                    await self._drop(keys=[self.key], args=[wid, value])
                except RedisError:
                    pass
            elif now - got[1] <= self.ttl_s:
                out[wid] = got
        return out

    async def close(self) -> None:
        await self._r.aclose()
