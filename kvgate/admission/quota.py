"""A tenant's quota check as a pure function: concurrency leases, then requests per minute, then tokens per
minute; all or nothing (a request refused for its tokens does not spend a request). Beside it, the
forced charges that settle what is known only later (a response's completion tokens) or that are not a
request's (background prefills), and a peek at a bucket.

The memory store runs this; the Redis store runs the same steps in Lua scripts (``redis_store.py``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Literal

from kvgate.admission.bucket import Bucket, Rate, debit, refill, wait_s

LimitName = Literal["max_concurrent", "requests_per_minute", "tokens_per_minute"]
BucketName = Literal["requests", "tokens", "prefill"]
"""``requests`` and ``tokens`` are a request's (requests and tokens per minute); ``prefill`` holds the
tenant's background-prefill tokens per minute."""


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
    prefill: Bucket | None = None
    leases: dict[str, float] = field(default_factory=dict)
    """Lease id -> expiry (seconds). Treated as immutable: every change makes a new dict."""


@dataclass(frozen=True, slots=True)
class Remaining:
    """What one rate limit has left after a request was admitted (OpenAI's ``x-ratelimit-*`` headers)."""

    limit: int
    remaining: float
    reset_s: float
    """Seconds until the bucket is full again."""


@dataclass(frozen=True, slots=True)
class Verdict:
    ok: bool
    limit: LimitName | None = None
    """The limit that refused the request."""
    limit_value: int = 0
    retry_after_s: float | None = None
    """When a retry can succeed (the rate limits); None: unknown (concurrency); inf: never (a request
    larger than a minute's tokens)."""
    requests: Remaining | None = None
    tokens: Remaining | None = None
    """Admitted: what the tenant's requests and tokens per minute have left (None: not limited)."""


OK = Verdict(True)


def remaining(b: Bucket, rate: Rate) -> Remaining:
    return Remaining(rate.per_minute, b.level, max(0.0, (rate.capacity - b.level) / rate.per_s))


def admit(s: TenantState, q: Quota, now: float, tokens: int, lease: str, lease_ttl_s: float
          ) -> tuple[TenantState, Verdict]:
    """Try to admit one request of ``tokens`` prompt tokens holding lease ``lease`` until ``now + ttl``."""
    leases = {k: v for k, v in s.leases.items() if v > now}  # expired leases: their holder died
    if q.max_concurrent is not None and len(leases) >= q.max_concurrent:
        return replace(s, leases=leases), Verdict(False, "max_concurrent", q.max_concurrent)
    rr = Rate(q.requests_per_minute) if q.requests_per_minute else None
    tr = Rate(q.tokens_per_minute) if q.tokens_per_minute else None
    req = refill(s.requests, rr, now) if rr else None
    tok = refill(s.tokens, tr, now) if tr else None
    if req is not None and rr is not None and req.level < 1:
        return replace(s, leases=leases), Verdict(False, "requests_per_minute", rr.per_minute, wait_s(req, rr, 1))
    if tok is not None and tr is not None and tok.level < tokens:
        return replace(s, leases=leases), Verdict(False, "tokens_per_minute", tr.per_minute, wait_s(tok, tr, tokens))
    if q.max_concurrent is not None:
        leases[lease] = now + lease_ttl_s
    req = replace(req, level=req.level - 1) if req else None
    tok = replace(tok, level=tok.level - tokens) if tok else None
    verdict = Verdict(True, requests=remaining(req, rr) if req and rr else None,
                      tokens=remaining(tok, tr) if tok and tr else None)
    return replace(s, requests=req, tokens=tok, leases=leases), verdict


def charge(s: TenantState, bucket: BucketName, per_minute: int, now: float, amount: float) -> TenantState:
    """Take ``amount`` from the tenant's ``bucket`` whatever it holds (a debt of up to a minute's worth):
    the completion tokens of a response that has ended, a background prefill that was issued."""
    b = debit(refill(_bucket(s, bucket), Rate(per_minute), now), Rate(per_minute), amount)
    if bucket == "requests":
        return replace(s, requests=b)
    return replace(s, tokens=b) if bucket == "tokens" else replace(s, prefill=b)


def _bucket(s: TenantState, name: BucketName) -> Bucket | None:
    return s.requests if name == "requests" else s.tokens if name == "tokens" else s.prefill


def level(s: TenantState, bucket: BucketName, per_minute: int, now: float) -> float:
    """What ``bucket`` holds at ``now`` (negative: in debt)."""
    return refill(_bucket(s, bucket), Rate(per_minute), now).level


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


def duration(seconds: float) -> str:
    """OpenAI's ``x-ratelimit-reset-*`` form: ``12ms``, ``1s``, ``6m0s``, ``1h2m3s``."""
    if seconds < 1:
        return f"{max(0, round(seconds * 1000))}ms"
    total = math.ceil(seconds)
    h, rest = divmod(total, 3600)
    m, sec = divmod(rest, 60)
    if h:
        return f"{h}h{m}m{sec}s"
    return f"{m}m{sec}s" if m else f"{sec}s"


def ratelimit_headers(v: Verdict) -> dict[str, str]:
    """``x-ratelimit-{limit,remaining,reset}-{requests,tokens}`` for the limits the tenant has."""
    out: dict[str, str] = {}
    for name, r in (("requests", v.requests), ("tokens", v.tokens)):
        if r is not None:
            out[f"x-ratelimit-limit-{name}"] = str(r.limit)
            out[f"x-ratelimit-remaining-{name}"] = str(max(0, math.floor(r.remaining)))
            out[f"x-ratelimit-reset-{name}"] = duration(r.reset_s)
    return out
