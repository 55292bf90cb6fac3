"""Tenants' quota state in Redis, shared by every gateway replica.

Keys (one hash tag per tenant, so a Redis Cluster keeps a tenant's keys in one slot for the script)::

    {prefix}{adm:<tenant>}:b       hash: r, ra (requests bucket level, time), t, ta (tokens bucket),
                                         p, pa (background-prefill bucket)
    {prefix}{adm:<tenant>}:leases  sorted set: lease id, score = expiry

One Lua script checks and takes all three limits atomically (``quota.admit``'s steps, in Redis's own
clock, so replicas with skewed clocks agree); another charges a bucket whatever it holds
(``quota.charge``), a third reads one. A lease expires unless its replica renews it, so the slots
of a replica that died come back after ``lease_ttl_s``."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from redis.exceptions import RedisError

from kvgate.admission.bucket import Bucket, Rate
from kvgate.admission.quota import OK, BucketName, LimitName, Quota, Remaining, Verdict, remaining
from kvgate.admission.store import QuotaStoreError
from kvgate.kvstore.redis_conversations import connect

_ADMIT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local maxc, rpm, tpm = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local tokens, lease, ttl = tonumber(ARGV[4]), ARGV[5], tonumber(ARGV[6])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
if maxc > 0 and redis.call('ZCARD', KEYS[2]) >= maxc then
  return {0, 'max_concurrent', ''}
end
local v = redis.call('HMGET', KEYS[1], 'r', 'ra', 't', 'ta')
%(refill)s
local r, tk
if rpm > 0 then
  r = refill(v[1], v[2], rpm)
  if r < 1 then return {0, 'requests_per_minute', tostring((1 - r) * 60 / rpm)} end
end
if tpm > 0 then
  if tokens > tpm then return {0, 'tokens_per_minute', 'inf'} end
  tk = refill(v[3], v[4], tpm)
  if tk < tokens then return {0, 'tokens_per_minute', tostring((tokens - tk) * 60 / tpm)} end
end
if rpm > 0 then redis.call('HSET', KEYS[1], 'r', tostring(r - 1), 'ra', tostring(now)) end
if tpm > 0 then redis.call('HSET', KEYS[1], 't', tostring(tk - tokens), 'ta', tostring(now)) end
if rpm > 0 or tpm > 0 then redis.call('EXPIRE', KEYS[1], 180) end
if maxc > 0 then
  redis.call('ZADD', KEYS[2], now + ttl, lease)
  redis.call('EXPIRE', KEYS[2], math.ceil(ttl) + 60)
end
return {1, '', '', tostring(r and (r - 1) or ''), tostring(tk and (tk - tokens) or '')}
"""
# A bucket idle for a minute is full again, and a debt is at most a minute's worth: what a missing key
# means after 120 s; 180 s of expiry suffices.

_REFILL = """
local function refill(level, at, per_min)
  if not level then return per_min end
  local l = tonumber(level) + math.max(0, now - tonumber(at)) * per_min / 60
  if l > per_min then return per_min end
  return l
end
"""
_ADMIT = _ADMIT.replace("%(refill)s", _REFILL)

_CHARGE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local f, fa, per_min, amount = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local v = redis.call('HMGET', KEYS[1], f, fa)
""" + _REFILL + """
local l = math.min(per_min, math.max(-per_min, refill(v[1], v[2], per_min) - amount))
redis.call('HSET', KEYS[1], f, tostring(l), fa, tostring(now))
redis.call('EXPIRE', KEYS[1], 180)
return tostring(l)
"""

_LEVEL = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local per_min = tonumber(ARGV[3])
local v = redis.call('HMGET', KEYS[1], ARGV[1], ARGV[2])
""" + _REFILL + """
return tostring(refill(v[1], v[2], per_min))
"""

_FIELDS: dict[BucketName, tuple[str, str]] = {"requests": ("r", "ra"), "tokens": ("t", "ta"), "prefill": ("p", "pa")}

_RENEW = """
local t = redis.call('TIME')
local until_ = tonumber(t[1]) + tonumber(t[2]) / 1000000 + tonumber(ARGV[1])
for i = 2, #ARGV do redis.call('ZADD', KEYS[1], 'XX', until_, ARGV[i]) end
redis.call('EXPIRE', KEYS[1], math.ceil(tonumber(ARGV[1])) + 60)
return 1
"""


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


class RedisQuotaStore:
    def __init__(self, url: str, prefix: str = "kvgate:", *, cluster: bool = False, timeout_s: float = 0.5) -> None:
        self._r = connect(url, cluster, timeout_s)
        self._prefix = prefix
        self._admit = self._r.register_script(_ADMIT)
        self._renew = self._r.register_script(_RENEW)
        self._charge = self._r.register_script(_CHARGE)
        self._level = self._r.register_script(_LEVEL)

    def _keys(self, tenant: str) -> list[str]:
        tag = f"{self._prefix}{{adm:{tenant}}}"
        return [f"{tag}:b", f"{tag}:leases"]

    async def admit(self, tenant: str, quota: Quota, tokens: int, lease: str, lease_ttl_s: float) -> Verdict:
        try:
            ok, limit, wait, *left = await self._admit(keys=self._keys(tenant), args=[
                quota.max_concurrent or 0, quota.requests_per_minute or 0, quota.tokens_per_minute or 0, tokens,
                lease, lease_ttl_s])
        except RedisError as exc:
            raise QuotaStoreError(str(exc)) from exc
        if int(ok):
            return _admitted(quota, [_s(x) for x in left])
        name: LimitName = _s(limit)  # type: ignore[assignment]  # the script returns one of the three
        value = {"max_concurrent": quota.max_concurrent, "requests_per_minute": quota.requests_per_minute,
                 "tokens_per_minute": quota.tokens_per_minute}[name] or 0
        w = _s(wait)
        return Verdict(False, name, value, None if not w else math.inf if w == "inf" else float(w))

    async def charge(self, tenant: str, bucket: BucketName, per_minute: int, amount: float) -> None:
        try:
            await self._charge(keys=self._keys(tenant)[:1], args=[*_FIELDS[bucket], per_minute, amount])
        except RedisError as exc:
            raise QuotaStoreError(str(exc)) from exc

    async def level(self, tenant: str, bucket: BucketName, per_minute: int) -> float:
        try:
            return float(_s(await self._level(keys=self._keys(tenant)[:1], args=[*_FIELDS[bucket], per_minute])))
        except RedisError as exc:
            raise QuotaStoreError(str(exc)) from exc

    async def release(self, tenant: str, lease: str) -> None:
        try:
            await self._r.zrem(self._keys(tenant)[1], lease)
        except RedisError as exc:
            raise QuotaStoreError(str(exc)) from exc

    async def renew(self, held: Mapping[str, set[str]], lease_ttl_s: float) -> None:
        try:
            for tenant, leases in held.items():
                if leases:
                    await self._renew(keys=[self._keys(tenant)[1]], args=[lease_ttl_s, *sorted(leases)])
        except RedisError as exc:
            raise QuotaStoreError(str(exc)) from exc

    async def leases(self, tenant: str) -> int:
        """Leases of ``tenant`` not expired (by Redis's clock)."""
        secs, micros = await self._r.time()
        n: int = await self._r.zcount(self._keys(tenant)[1], f"({secs + micros / 1e6}", "+inf")
        return n

    async def close(self) -> None:
        await self._r.aclose()


def _admitted(quota: Quota, left: list[str]) -> Verdict:
    """The script's remaining levels as the core's ``Verdict`` (the times are now: only the levels matter)."""
    if len(left) < 2:
        return OK

    def one(per_min: int | None, level: str) -> Remaining | None:
        return remaining(Bucket(float(level), 0.0), Rate(per_min)) if per_min and level else None

    return Verdict(True, requests=one(quota.requests_per_minute, left[0]), tokens=one(quota.tokens_per_minute, left[1]))
