"""What every replica routed to the workers without KV events, for the others (``gateway/routedsync.py``).

Without events a replica knows a worker holds a prompt only because it routed it there; with N replicas
each would know 1/N of the fleet's routes, and one that joins nothing. So each replica adds the blocks
it routed (only those not published recently) to one sorted set per worker and hash identity, scored by
the wall time they were routed, and reads the others' newest entries on a short poll::

    {prefix}routed:{worker}:{spec}   zset: <8-byte block hash> -> <wall time last routed>

Bounded like the approximate index itself: entries older than the approximate TTL are trimmed, and no
more than the worker's KV capacity in blocks are kept (the oldest go first); the key expires with its
newest entry. Entries are validated on read and a corrupt one is removed (another writer, a bug, a
hand edit): it heals instead of poisoning every replica's index.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import Protocol

from redis.exceptions import RedisError

from kvgate.kvstore.redis_conversations import Client, connect

log = logging.getLogger("kvgate.routed")

Entries = Sequence[tuple[int, float]]
"""(block hash, wall time routed) pairs."""

SKEW_S = 60.0
"""How far in the future an entry may be (replicas' clocks disagree a little); later ones are corrupt."""


def encode(h: int) -> bytes:
    return h.to_bytes(8, "big")


def parse(member: object, score: object, now: float, ttl_s: float) -> tuple[int, float] | None:
    """An entry, or None for one kvgate did not write (removed by the reader). One older than the TTL is
    not corrupt, only past (the next write trims it)."""
    if not isinstance(member, bytes) or len(member) != 8 or not isinstance(score, float) or not math.isfinite(score):
        return None
    if score <= 0 or score > now + SKEW_S:
        return None
    return int.from_bytes(member, "big"), score


class RoutedRecord(Protocol):
    async def publish(self, batch: Mapping[str, tuple[Entries, int]], now: float) -> None:
        """``batch``: per record name, its new entries and how many blocks the record may keep."""
        ...

    async def read(self, since: Mapping[str, tuple[float, int]], now: float) -> dict[str, list[tuple[int, float]]]:
        """Per record name, its entries routed after the time given, at most the count given (newest)."""
        ...

    async def close(self) -> None: ...


class RedisRoutedRecord:
    def __init__(self, url: str, prefix: str, ttl_s: float, *, cluster: bool = False, timeout_s: float = 0.5) -> None:
        self._r: Client = connect(url, cluster, timeout_s)
        self._prefix = f"{prefix}routed:"
        self.ttl_s = ttl_s
        self.corrupt = 0
        """Entries refused on read (and removed)."""

    def key(self, name: str) -> str:
        return self._prefix + name

    async def publish(self, batch: Mapping[str, tuple[Entries, int]], now: float) -> None:
        """Raises RedisError: the caller counts it (the record is advice, a write lost costs reuse only)."""
        if not batch:
            return
        async with self._r.pipeline(transaction=False) as pipe:
            for name, (entries, cap) in batch.items():
                key = self.key(name)
                if entries:
                    pipe.zadd(key, {encode(h): at for h, at in entries}, gt=True)
                pipe.zremrangebyscore(key, "-inf", now - self.ttl_s)
                if cap > 0:
                    pipe.zremrangebyrank(key, 0, -cap - 1)
                pipe.pexpire(key, max(1000, int(self.ttl_s * 1000)))
            await pipe.execute()

    async def read(self, since: Mapping[str, tuple[float, int]], now: float) -> dict[str, list[tuple[int, float]]]:
        names = list(since)
        if not names:
            return {}
        async with self._r.pipeline(transaction=False) as pipe:
            for name in names:
                t, cap = since[name]
                pipe.zrevrangebyscore(self.key(name), "+inf", f"({max(t, now - self.ttl_s)!r}", start=0,
                                      num=max(1, cap), withscores=True)
            results = await pipe.execute(raise_on_error=False)
        out: dict[str, list[tuple[int, float]]] = {}
        for name, got in zip(names, results, strict=True):
            if isinstance(got, Exception):  # a wrong type: nothing from that record this round
                log.debug("routed record %s: %s", name, got)
                continue
            good, bad = [], []
            for member, score in got:
                e = parse(member, score, now, self.ttl_s)
                if e is None:
                    bad.append(member)
                else:
                    good.append(e)
            out[name] = good
            if bad:
                self.corrupt += len(bad)
                try:
                    await self._r.zrem(self.key(name), *bad)
                except RedisError:
                    pass
        return out

    async def close(self) -> None:
        await self._r.aclose()
