"""The fleet state of ``kvstore/fleet.py`` in Redis, shared by every gateway replica.

Keys (one hash tag, so a Redis Cluster keeps them all in one slot for their scripts)::

    {prefix}{fleet}:timers            sorted set: member "<cid>\\x1f<kind>", score = due (wall seconds)
    {prefix}{fleet}:tokens            hash: member -> token of the armed timer
    {prefix}{fleet}:obs               stream of observations (msgpack), capped at ``max_observations``
    {prefix}{fleet}:reserved          hash: "<worker>\\x1f<cid>" -> "<tokens>:<deadline>"
    {prefix}{fleet}:parked:<tenant>   hash: the same entries, the tenant's only; expires a minute after
                                      its last deadline

Claiming is one Lua script: the due members are re-scored to ``now + lease`` and returned, so two
replicas never claim the same firing; a claimer that dies leaves the member due again at the lease's
end. ``done`` removes the member only if its token is still the one claimed (not re-armed meanwhile).
Reserving is one too: it sums the tenant's live entries (dropping those past their deadline), refuses
when the new one would take the tenant over its budget, else writes both hashes, so replicas that
reserve for one tenant at once cannot both overshoot. The tenant hashes are pruned by deadline (the
script drops what has passed, ``reserved_by`` skips it) and expire by themselves, so a tenant that stops
reserving leaves nothing behind. The per-worker hash keeps its form: an older replica in a rolling
upgrade reads it as before (what it reserves is not counted against its tenant until it is replaced).
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgpack
from redis.exceptions import RedisError

from kvgate.kvstore.codec import CodecError, from_map, to_map
from kvgate.kvstore.conversations import StoreError
from kvgate.kvstore.corrupt import Corruption
from kvgate.kvstore.fleet import Timer
from kvgate.kvstore.redis_conversations import WrongType, connect, is_wrong_type
from kvgate.router.types import ConversationId, WorkerId
from kvgate.session.state import ContinuationObserved, Observation, WaitObserved

_SEP = "\x1f"

_ARM = """
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[3])
return 1
"""
_CANCEL = """
for i = 1, #ARGV do
  redis.call('ZREM', KEYS[1], ARGV[i])
  redis.call('HDEL', KEYS[2], ARGV[i])
end
return 1
"""
_CLAIM = """
-- Both keys' types checked on every tick (WRONGTYPE otherwise), not only when a timer is due.
redis.call('HLEN', KEYS[2])
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, ARGV[3])
local out = {}
for _, m in ipairs(due) do
  redis.call('ZADD', KEYS[1], ARGV[2], m)
  table.insert(out, m)
  table.insert(out, redis.call('HGET', KEYS[2], m) or '0')
end
return out
"""
_DONE = """
if (redis.call('HGET', KEYS[2], ARGV[1]) or '0') == ARGV[2] then
  redis.call('ZREM', KEYS[1], ARGV[1])
  redis.call('HDEL', KEYS[2], ARGV[1])
  return 1
end
return 0
"""
_RENEW = """
if redis.call('HGET', KEYS[2], ARGV[1]) == ARGV[2] then
  redis.call('ZADD', KEYS[1], 'XX', ARGV[3], ARGV[1])
  return 1
end
return 0
"""
_RESERVE = """
local member, value = ARGV[1], ARGV[2]
local tokens, now, budget, last = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local held = redis.call('HGETALL', KEYS[2])
local total = 0
for i = 1, #held, 2 do
  local n, d = string.match(held[i + 1], '^([^:]*):(.*)$')
  n, d = tonumber(n), tonumber(d)
  -- Not an entry this script wrote (no number, nan, a day or more ahead, negative or past any worker's
  -- KV): dropped
  -- with the lapsed ones, or it would count against the tenant's budget for ever.
  if d == nil or n == nil or d ~= d or d > now + 86400 or n < 0 or n >= 2^40 or d <= now then
    redis.call('HDEL', KEYS[2], held[i])
  elseif held[i] ~= member then
    total = total + n
    if d > last then last = d end
  end
end
if budget >= 0 and total + tokens > budget then return 0 end
redis.call('HSET', KEYS[1], member, value)
redis.call('HSET', KEYS[2], member, value)
redis.call('EXPIRE', KEYS[2], math.max(60, math.ceil(last - now) + 60))
return 1
"""
_UNRESERVE = """
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
return 1
"""
_KINDS: dict[str, Any] = {"wait": WaitObserved, "continuation": ContinuationObserved}
_MAX_TOKENS = 1 << 40
"""More KV tokens than any worker holds: a reservation claiming more is not one kvgate wrote."""
_HORIZON_S = 86400.0
"""Reservations last seconds (``reserve_max_s``): one whose deadline is a day ahead would hold a worker's
KV for ever. The reserve script drops the same."""


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _timer(member: Any, token: Any) -> Timer | None:
    try:
        cid, sep, kind = _text(member).partition(_SEP)
        return Timer(ConversationId(cid), kind, int(_text(token))) if cid and sep and kind else None
    except (UnicodeDecodeError, ValueError):
        return None


def _parked(key: Any, value: Any) -> tuple[WorkerId, int, float] | None:
    """(worker, tokens, deadline) of a reservation entry; None when it is not one this version wrote.
    The horizon is the wall clock's, not the caller's ``now``: a question about another moment (a test's
    ``now=0``: "everything not lapsed by then") must not find every entry corrupt and delete it."""
    now = time.time()
    try:
        worker, sep, cid = _text(key).partition(_SEP)
        tokens, colon, until = _text(value).partition(":")
        n, d = int(tokens), float(until)
    except (UnicodeDecodeError, ValueError):
        return None
    ok = worker and sep and cid and colon and 0 <= n < _MAX_TOKENS and math.isfinite(d) and d < now + _HORIZON_S
    return (WorkerId(worker), n, d) if ok else None


def _observation(raw: Any) -> Observation | str | None:
    """The observation; None for one in a form a newer replica may write (an unknown kind: kept); the
    reason it is corrupt otherwise."""
    try:
        m = msgpack.unpackb(raw, raw=False)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        return f"not msgpack: {exc}"
    if not isinstance(m, dict) or not isinstance(m.get("k"), str):
        return "not a map with a kind"
    cls = _KINDS.get(m["k"])
    if cls is None:
        return None
    try:
        obs: Observation = from_map(cls, m.get("o"))
    except CodecError as exc:
        return str(exc)
    nums = [getattr(obs, f) for f in ("waited_s", "predicted_s", "size") if hasattr(obs, f)]
    if not all(math.isfinite(x) and x >= 0 for x in nums):
        return "a negative or non-finite figure"
    return obs


class RedisFleet:
    def __init__(self, url: str, prefix: str = "kvgate:", *, cluster: bool = False, timeout_s: float = 0.5,
                 max_observations: int = 100_000) -> None:
        self._r = connect(url, cluster, timeout_s)
        tag = f"{prefix}{{fleet}}"
        self._timers, self._tokens = f"{tag}:timers", f"{tag}:tokens"
        self._obs, self._res = f"{tag}:obs", f"{tag}:reserved"
        self._arm = self._r.register_script(_ARM)
        self._cancel = self._r.register_script(_CANCEL)
        self._claim = self._r.register_script(_CLAIM)
        self._done = self._r.register_script(_DONE)
        self._renew = self._r.register_script(_RENEW)
        self._reserve = self._r.register_script(_RESERVE)
        self._unreserve = self._r.register_script(_UNRESERVE)
        self._tag = tag
        self._max_obs = max_observations
        self.corruption = Corruption()
        self.round_trips = 0
        self._last_obs = "0"
        """Stream id read up to: "0" at start, so a new replica reads the kept history (starts warm)."""

    async def _call(self, aw: Any) -> Any:
        self.round_trips += 1
        try:
            return await aw
        except RedisError as exc:
            if is_wrong_type(exc):
                raise WrongType(str(exc)) from exc
            raise StoreError(f"fleet store unavailable: {exc!r}") from exc

    async def _heal(self, keys: tuple[str, ...], make: Callable[[], Awaitable[Any]]) -> Any:
        """``make()``'s answer; when one of ``keys`` holds another Redis type (someone else wrote it),
        that key is deleted and ``make()`` runs once more: a key that never heals would stop every
        replica's timers or reservations."""
        try:
            return await self._call(make())
        except WrongType:
            for key in keys:
                want, kind = self._shape(key)
                got = _text(await self._call(self._r.type(key)))
                if got not in (want, "none"):
                    self.corruption.found(kind, key, f"a {got} where a {want} belongs")
                    await self._call(self._r.delete(key))
            return await self._call(make())

    def _shape(self, key: str) -> tuple[str, str]:
        """(Redis type, key kind) of one of this store's keys."""
        return {self._timers: ("zset", "timer"), self._tokens: ("hash", "timer_token"),
                self._obs: ("stream", "observation"), self._res: ("hash", "reservation")
                }.get(key, ("hash", "parked"))

    async def arm(self, cid: ConversationId, kind: str, due: float, token: int) -> None:
        await self._heal((self._timers, self._tokens), lambda: self._arm(
            keys=[self._timers, self._tokens], args=[f"{cid}{_SEP}{kind}", repr(due), token]))

    async def cancel(self, cid: ConversationId, kinds: tuple[str, ...]) -> None:
        if kinds:
            await self._drop_timers([f"{cid}{_SEP}{k}" for k in kinds])

    async def _drop_timers(self, members: list[Any]) -> None:
        await self._heal((self._timers, self._tokens), lambda: self._cancel(
            keys=[self._timers, self._tokens], args=members))

    async def claim(self, now: float, lease_s: float, limit: int = 64) -> list[Timer]:
        raw = await self._heal((self._timers, self._tokens), lambda: self._claim(
            keys=[self._timers, self._tokens], args=[repr(now), repr(now + lease_s), limit]))
        out, bad = [], []
        for member, token in zip(raw[::2], raw[1::2], strict=True):
            t = _timer(member, token)
            if t is None:
                self.corruption.found("timer", repr(member)[:200], "not <conversation>\\x1f<kind> with a number")
                bad.append(member)
            else:
                out.append(t)
        if bad:
            await self._drop_timers(bad)
        return out

    async def renew(self, timer: Timer, until: float) -> None:
        await self._heal((self._timers, self._tokens), lambda: self._renew(
            keys=[self._timers, self._tokens],
            args=[f"{timer.conversation}{_SEP}{timer.kind}", str(timer.token), repr(until)]))

    async def done(self, timer: Timer) -> None:
        await self._heal((self._timers, self._tokens), lambda: self._done(
            keys=[self._timers, self._tokens], args=[f"{timer.conversation}{_SEP}{timer.kind}", str(timer.token)]))

    async def publish(self, obs: Observation) -> None:
        kind = "wait" if isinstance(obs, WaitObserved) else "continuation"
        payload = msgpack.packb({"k": kind, "o": to_map(obs)}, use_bin_type=True)
        await self._heal((self._obs,), lambda: self._r.xadd(self._obs, {"o": payload}, maxlen=self._max_obs,
                                                            approximate=True))

    async def observations(self) -> list[Observation]:
        got = await self._heal((self._obs,), lambda: self._r.xread({self._obs: self._last_obs}, count=10_000))
        out: list[Observation] = []
        bad = []
        for _stream, entries in got or ():
            for eid, fields in entries:
                self._last_obs = _text(eid)
                raw = fields.get(b"o") if b"o" in fields else fields.get("o")
                obs = _observation(raw)
                if isinstance(obs, str):
                    self.corruption.found("observation", self._last_obs, obs)
                    bad.append(eid)
                elif obs is not None:  # None: a newer replica's kind, left for it
                    out.append(obs)
        if bad:
            await self._call(self._r.xdel(self._obs, *bad))
        return out

    def _parked(self, tenant: str) -> str:
        return f"{self._tag}:parked:{tenant}"

    async def reserve(self, worker: WorkerId, cid: ConversationId, tokens: int, until: float, *, tenant: str,
                      now: float, budget: int | None = None) -> bool:
        keys = (self._res, self._parked(tenant))
        ok = await self._heal(keys, lambda: self._reserve(keys=list(keys), args=[
            f"{worker}{_SEP}{cid}", f"{tokens}:{until!r}", tokens, repr(now), -1 if budget is None else budget,
            repr(until)]))
        return bool(int(ok))

    async def unreserve(self, worker: WorkerId, cid: ConversationId, *, tenant: str) -> None:
        keys = (self._res, self._parked(tenant))
        await self._heal(keys, lambda: self._unreserve(keys=list(keys), args=[f"{worker}{_SEP}{cid}"]))

    async def reserved_by(self, tenant: str, now: float) -> int:
        key = self._parked(tenant)
        held = await self._heal((key,), lambda: self._r.hgetall(key))
        total = 0
        bad = []
        for k, v in held.items():
            p = _parked(k, v)
            if p is None:
                self.corruption.found("parked", f"{key}[{k!r}]"[:200], "not <tokens>:<deadline>")
                bad.append(k)
            elif p[2] > now:
                total += p[1]
        if bad:
            await self._call(self._r.hdel(key, *bad))
        return total

    async def reserved(self, now: float) -> dict[WorkerId, int]:
        held = await self._heal((self._res,), lambda: self._r.hgetall(self._res))
        out: dict[WorkerId, int] = {}
        drop = []
        for k, v in held.items():
            p = _parked(k, v)
            if p is None:
                self.corruption.found("reservation", repr(k)[:200], "not <worker>\\x1f<cid> -> <tokens>:<deadline>")
                drop.append(k)
            elif p[2] <= now:
                drop.append(k)
            else:
                out[p[0]] = out.get(p[0], 0) + p[1]
        if drop:
            await self._call(self._r.hdel(self._res, *drop))
        return out

    async def close(self) -> None:
        await self._r.aclose()
