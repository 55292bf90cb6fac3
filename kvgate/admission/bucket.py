"""A token bucket as a pure function of its state and the time: the core the memory store runs and the
Redis store's Lua script mirrors (``redis_store.py``; ``tests/test_admission_core.py`` checks they agree)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Bucket:
    """``level`` tokens at time ``at`` (seconds)."""

    level: float
    at: float


@dataclass(frozen=True, slots=True)
class Rate:
    """``per_minute`` tokens a minute, at most ``per_minute`` saved up (a minute's worth: a tenant idle for
    a minute may spend its whole minute at once, as OpenAI's limits allow)."""

    per_minute: int

    @property
    def per_s(self) -> float:
        return self.per_minute / 60.0

    @property
    def capacity(self) -> float:
        return float(self.per_minute)


def refill(b: Bucket | None, rate: Rate, now: float) -> Bucket:
    """The bucket at ``now`` (a new one is full). A clock that went back refills nothing."""
    if b is None:
        return Bucket(rate.capacity, now)
    return Bucket(min(rate.capacity, b.level + max(0.0, now - b.at) * rate.per_s), max(b.at, now))


def wait_s(b: Bucket, rate: Rate, cost: float) -> float:
    """Seconds until ``b`` holds ``cost``; inf when it never will (more than its capacity)."""
    if cost > rate.capacity:
        return math.inf
    return max(0.0, (cost - b.level) / rate.per_s)


def debit(b: Bucket, rate: Rate, amount: float) -> Bucket:
    """``b`` less ``amount``, into debt if need be but never more than a minute's worth (a tenant that
    overspent once waits at most a minute longer, not forever); a negative amount gives tokens back, up to
    the capacity."""
    return Bucket(min(rate.capacity, max(-rate.capacity, b.level - amount)), b.at)
