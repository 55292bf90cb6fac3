"""LMCache tier control at the edge: what Redis (LMCache's L2) holds of a prompt, and warming a node's
L1 from it. Both are advisory: an error makes the tier look empty (counted), never fails a request,
and after ``retry_s`` the adapter tries again, so it recovers when Redis or LMCache return.

Keys: kvgate computes LMCache's own keys for the prompt's tokens (``router/hashing.LMCacheKeys``, checked
key for key against a live LMCache 0.5.6) and asks Redis with one pipelined ``EXISTS`` per chunk; the
answer is the longest run of present chunks from the start, in tokens.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import httpx
import redis.asyncio as aioredis
from prometheus_client.parser import text_string_to_metric_families
from redis.exceptions import RedisError

from kvgate.router.hashing import LMCacheKeys

log = logging.getLogger(__name__)


class _Breaker:
    """After a failure, skip calls for ``retry_s`` (a down tier costs one timeout, not one per request)."""

    def __init__(self, now: Callable[[], float], retry_s: float) -> None:
        self._now = now
        self._retry_s = retry_s
        self._until = 0.0
        self.errors = 0
        self.up = True

    def open(self) -> bool:
        return self._now() >= self._until

    def failed(self, what: str, exc: BaseException) -> None:
        self.errors += 1
        if self.up:
            log.warning("%s unreachable, treating the tier as empty: %s", what, exc)
        self.up = False
        self._until = self._now() + self._retry_s

    def ok(self) -> None:
        if not self.up:
            log.info("tier back")
        self.up = True


@dataclass(frozen=True)
class TierResidency:
    """What a tier oracle knows of a prompt: its L2 prefix (tokens), and per LMCache instance its L1's
    prefix (None: the oracle does not see L1, kvgate estimates it from the conversation's record)."""

    l1: dict[str, int] | None = None
    l2: int = 0


class TierOracle(Protocol):
    """Where a prompt's chunks are (``RemoteTierProbe``: Redis keys; ``LMCacheCoordinator``: the
    coordinator's directory). Advisory: a failure answers empty and opens ``breaker``."""

    breaker: _Breaker

    async def residency(self, model_path: str, tokens: Sequence[int], cache_salt: str | None = None
                        ) -> TierResidency: ...

    async def aclose(self) -> None: ...


class RemoteTierProbe:
    def __init__(self, url: str, now: Callable[[], float], *, chunk_tokens: int = 256, timeout_s: float = 0.05,
                 retry_s: float = 5.0, max_chunks: int = 2048) -> None:
        self._redis = aioredis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self.chunk_tokens = chunk_tokens
        self.max_chunks = max_chunks
        self.breaker = _Breaker(now, retry_s)
        self.lookups = 0

    async def prefix_tokens(self, model_path: str, tokens: Sequence[int], cache_salt: str | None = None) -> int:
        """Tokens of ``tokens``' prefix whose chunks LMCache holds in Redis (0 when unknown), under
        ``cache_salt`` (a salted chunk's key carries the salt: another tenant's is never probed)."""
        if not self.breaker.open() or len(tokens) < self.chunk_tokens:
            return 0
        keys = LMCacheKeys(model_path, self.chunk_tokens).redis_keys(tokens[: self.max_chunks * self.chunk_tokens],
                                                                     cache_salt)
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                for k in keys:
                    pipe.exists(k)
                found = await pipe.execute()
        except (RedisError, OSError, TimeoutError) as exc:
            self.breaker.failed("remote tier (Redis)", exc)
            return 0
        self.breaker.ok()
        self.lookups += 1
        n = 0
        for f in found:
            if not f:
                break
            n += 1
        return n * self.chunk_tokens

    async def residency(self, model_path: str, tokens: Sequence[int], cache_salt: str | None = None
                        ) -> TierResidency:
        return TierResidency(l2=await self.prefix_tokens(model_path, tokens, cache_salt))

    async def aclose(self) -> None:
        await self._redis.aclose()


class LMCacheControl:
    """One LMCache server's HTTP API (multiprocess mode): warm its L1 from L2 for a token sequence
    (``POST /cache/prefetches``; LMCache hashes the tokens itself and keeps the chunks in L1)."""

    def __init__(self, url: str, client: httpx.AsyncClient, now: Callable[[], float], *, timeout_s: float = 2.0,
                 retry_s: float = 5.0) -> None:
        self.url = url.rstrip("/")
        self._client = client
        self._timeout = timeout_s
        self.breaker = _Breaker(now, retry_s)
        self.prefetches = 0

    async def prefetch(self, model_path: str, tokens: Sequence[int], cache_salt: str = "") -> str | None:
        """Submit a prefetch; returns LMCache's request id, or None (nothing to fetch, or unreachable)."""
        if not self.breaker.open():
            return None
        try:
            r = await self._client.post(f"{self.url}/cache/prefetches", timeout=self._timeout, json={
                "model_name": model_path, "world_size": 1, "token_ids": list(tokens), "cache_salt": cache_salt,
                "source_tier": "l2", "target_tier": "l1"})
            r.raise_for_status()
            body = r.json()
        except (httpx.HTTPError, ValueError) as exc:
            self.breaker.failed(f"LMCache at {self.url}", exc)
            return None
        self.breaker.ok()
        self.prefetches += 1
        rid = body.get("request_id") if isinstance(body, dict) else None
        return rid if isinstance(rid, str) else None

    async def prefetch_result(self, request_id: str) -> tuple[int, int] | None:
        """(found chunks, total chunks) once LMCache finished the prefetch; None while pending."""
        try:
            r = await self._client.get(f"{self.url}/cache/prefetches/{request_id}", timeout=self._timeout)
            r.raise_for_status()
            body = r.json()
        except (httpx.HTTPError, ValueError) as exc:
            self.breaker.failed(f"LMCache at {self.url}", exc)
            return None
        if body.get("status") != "completed":
            return None
        return int(body.get("found_keys", 0)), int(body.get("total_keys", 0))


# LMCache 0.5.6's OpenTelemetry histograms (GB/s per transfer), exported to Prometheus as
# ``<name>_GB_per_second_{bucket,sum,count}``.
L1_TO_GPU = "lmcache_mp_l0_l1_load_throughput"
L2_TO_L1 = "lmcache_mp_l2_load_throughput"


@dataclass
class _Ewma:
    alpha: float
    value: float | None = None
    samples: int = 0

    def add(self, x: float, n: int) -> None:
        self.value = x if self.value is None else self.value + self.alpha * (x - self.value)
        self.samples += n


@dataclass
class TransferRates:
    """Load rates learned from LMCache servers' own throughput histograms: per scrape, the mean of the
    transfers since the last one (delta of ``_sum`` over delta of ``_count``), folded into an EWMA. The
    histograms time submit to completion, queueing included: what a request waiting on a load sees."""

    alpha: float = 0.3
    cpu: _Ewma = field(init=False)
    """L1 (CPU) to the engine's KV (LMCache's L0)."""
    l2: _Ewma = field(init=False)
    """L2 (remote) into L1."""
    _last: dict[tuple[str, str], tuple[float, float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.cpu, self.l2 = _Ewma(self.alpha), _Ewma(self.alpha)

    def observe(self, source: str, text: str) -> None:
        """Fold in one scrape of ``source``'s ``/metrics``."""
        totals: dict[str, list[float]] = {}
        for fam in text_string_to_metric_families(text):
            for name in (L1_TO_GPU, L2_TO_L1):
                if not fam.name.startswith(name):
                    continue
                acc = totals.setdefault(name, [0.0, 0.0])
                for s in fam.samples:
                    if s.name.endswith("_sum"):
                        acc[0] += s.value
                    elif s.name.endswith("_count"):
                        acc[1] += s.value
        for name, ewma in ((L1_TO_GPU, self.cpu), (L2_TO_L1, self.l2)):
            if name not in totals:
                continue
            total, count = totals[name]
            last_total, last_count = self._last.get((source, name), (0.0, 0.0))
            self._last[(source, name)] = (total, count)
            if count < last_count:  # the server restarted: its counters began again
                last_total, last_count = 0.0, 0.0
            n = count - last_count
            if n > 0 and total > last_total:
                ewma.add((total - last_total) / n, int(n))

    def remote_gbps(self, cpu_gbps: float) -> float | None:
        """L2 to the engine: into L1, then L1 to the engine, in series. The second leg at the learned rate,
        else at ``cpu_gbps`` (LMCache 0.5.6 exports no L0<->L1 samples for vLLM-CPU's KV, measured)."""
        if self.l2.value is None:
            return None
        cpu = self.cpu.value or cpu_gbps
        return 1.0 / (1.0 / self.l2.value + 1.0 / cpu)

    def snapshot(self, cpu_gbps: float) -> dict[str, float | int | None]:
        return {"cpu_load_gbps": self.cpu.value, "l2_to_l1_gbps": self.l2.value,
                "remote_load_gbps": self.remote_gbps(cpu_gbps), "cpu_samples": self.cpu.samples,
                "l2_samples": self.l2.samples}


async def scrape_rates(rates: TransferRates, client: httpx.AsyncClient, urls: Iterable[str],
                       timeout_s: float = 2.0) -> int:
    """Scrape each LMCache server's ``/metrics`` into ``rates``; how many answered (advisory)."""
    ok = 0
    for url in urls:
        try:
            r = await client.get(f"{url.rstrip('/')}/metrics", timeout=timeout_s)
            r.raise_for_status()
        except httpx.HTTPError as exc:
            log.debug("LMCache metrics at %s: %r", url, exc)
            continue
        rates.observe(url, r.text)
        ok += 1
    return ok
