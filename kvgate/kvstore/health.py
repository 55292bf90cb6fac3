"""Worker ejections one replica saw, for the others (``gateway/workers.py``).

A replica that ejects a worker (a refused connection, failed checks, requests that failed there) writes
when and by whom; every replica reads the board after each round of its own checks and ejects a worker
another replica ejected since it last looked. Its own next check then decides: a worker that answers
comes back on probation (its first failure ejects it again), as after an ejection of its own. So a
worker the fleet knows is down is avoided by every replica within one health interval, and a replica
that joins does not route to it before its own check has had a say::

    {prefix}health   hash: <worker id> -> "<wall time>|<replica id>"  (expires with its newest entry)
"""

from __future__ import annotations

import logging
from typing import Protocol

from redis.exceptions import RedisError

from kvgate.kvstore.redis_conversations import Client, connect

log = logging.getLogger("kvgate.health")


class HealthBoard(Protocol):
    async def ejected(self, worker: str, at: float, by: str) -> None: ...

    async def read(self) -> dict[str, tuple[float, str]]:
        """worker -> (when, by which replica) of its latest ejection still on the board."""
        ...

    async def close(self) -> None: ...


class MemoryHealthBoard:
    """One process: nobody else to tell (kept so one code path serves both)."""

    def __init__(self) -> None:
        self._marks: dict[str, tuple[float, str]] = {}

    async def ejected(self, worker: str, at: float, by: str) -> None:
        self._marks[worker] = (at, by)

    async def read(self) -> dict[str, tuple[float, str]]:
        return dict(self._marks)

    async def close(self) -> None:
        return None


def parse(value: bytes) -> tuple[float, str] | None:
    """An entry, or None for one this kvgate did not write (dropped by the reader)."""
    try:
        at, sep, by = value.decode().partition("|")
        t = float(at)
    except (UnicodeDecodeError, ValueError):
        return None
    return (t, by) if sep and by and t == t and t > 0 else None


class RedisHealthBoard:
    def __init__(self, url: str, prefix: str, ttl_s: float, *, cluster: bool = False, timeout_s: float = 0.5) -> None:
        self._r: Client = connect(url, cluster, timeout_s)
        self._key = f"{prefix}health"
        self._ttl_ms = max(1000, int(ttl_s * 1000))

    async def ejected(self, worker: str, at: float, by: str) -> None:
        try:
            async with self._r.pipeline(transaction=False) as pipe:
                pipe.hset(self._key, worker, f"{at:.6f}|{by}")
                pipe.pexpire(self._key, self._ttl_ms)
                await pipe.execute()
        except RedisError as exc:
            log.warning("health board write: %s", exc)

    async def read(self) -> dict[str, tuple[float, str]]:
        try:
            raw = await self._r.hgetall(self._key)
        except RedisError as exc:  # a wrong type included: nothing learned this round
            log.debug("health board read: %s", exc)
            return {}
        out, bad = {}, []
        for k, v in raw.items():
            mark = parse(v) if isinstance(v, bytes) else None
            if mark is None or not isinstance(k, bytes):
                bad.append(k)
            else:
                out[k.decode(errors="replace")] = mark
        if bad:
            try:
                await self._r.hdel(self._key, *bad)
            except RedisError:
                pass
        return out

    async def close(self) -> None:
        await self._r.aclose()
