"""A tenant's quota check as a pure function: concurrency leases, then requests per minute, then tokens per
minute; all or nothing (a request refused for its tokens does not spend a request).

The memory store runs this; the Redis store runs the same steps in one Lua script."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Literal

from kvgate.admission.bucket import Bucket, Rate, refill, wait_s

LimitName = Literal["max_concurrent", "requests_per_minute", "tokens_per_minute"]


@dataclass(frozen=True, slots=True)
class Quota:
    """A tenant's limits in the core's terms; None: unlimited."""

    max_concurrent: int | None = None
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None

    @property
    def unlimited(self) -> bool:
        return self.max_concurrent is None and self.requests_per_minute is None and self.tokens_per_minute is None


@dataclass(frozen=True, slots=True)
class TenantState:
    requests: Bucket | None = None
    tokens: Bucket | None = None
    leases: dict[str, float] = field(default_factory=dict)
    """Lease id -> expiry (seconds). Treated as immutable: every change makes a new dict."""


@dataclass(frozen=True, slots=True)
class Verdict:
    ok: bool
    limit: LimitName | None = None
    """The limit that refused the request."""
    limit_value: int = 0
    retry_after_s: float | None = None
    """When a retry can succeed (the rate limits); None: unknown (concurrency); inf: never (a request
    larger than a minute's tokens)."""


OK = Verdict(True)


def admit(s: TenantState, q: Quota, now: float, tokens: int, lease: str, lease_ttl_s: float
          ) -> tuple[TenantState, Verdict]:
    """Try to admit one request of ``tokens`` prompt tokens holding lease ``lease`` until ``now + ttl``."""
    leases = {k: v for k, v in s.leases.items() if v > now}  # expired leases: their holder died
    if q.max_concurrent is not None and len(leases) >= q.max_concurrent:
        return replace(s, leases=leases), Verdict(False, "max_concurrent", q.max_concurrent)
    req = refill(s.requests, Rate(q.requests_per_minute), now) if q.requests_per_minute else None
    tok = refill(s.tokens, Rate(q.tokens_per_minute), now) if q.tokens_per_minute else None
    if req is not None and q.requests_per_minute is not None and req.level < 1:
        return replace(s, leases=leases), Verdict(False, "requests_per_minute", q.requests_per_minute,
                                                  wait_s(req, Rate(q.requests_per_minute), 1))
    if tok is not None and q.tokens_per_minute is not None and tok.level < tokens:
        return replace(s, leases=leases), Verdict(False, "tokens_per_minute", q.tokens_per_minute,
                                                  wait_s(tok, Rate(q.tokens_per_minute), tokens))
    if q.max_concurrent is not None:
        leases[lease] = now + lease_ttl_s
    return TenantState(replace(req, level=req.level - 1) if req else None,
                       replace(tok, level=tok.level - tokens) if tok else None, leases), OK


def release(s: TenantState, lease: str) -> TenantState:
    return replace(s, leases={k: v for k, v in s.leases.items() if k != lease})


def renew(s: TenantState, leases: set[str], until: float) -> TenantState:
    """Extend the leases this replica still holds (those it no longer holds are left to expire)."""
    return replace(s, leases={k: (until if k in leases else v) for k, v in s.leases.items()})


def retry_after_header(v: Verdict, fallback_s: int) -> str | None:
    """Whole seconds for ``Retry-After`` (rounded up, at least 1); None when a retry can never succeed."""
    if v.retry_after_s is None:
        return str(max(1, fallback_s))
    if math.isinf(v.retry_after_s):
        return None
    return str(max(1, math.ceil(v.retry_after_s)))
