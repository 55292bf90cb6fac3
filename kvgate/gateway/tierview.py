"""What kvgate knows of the LMCache tiers when it routes, and the prefetch it can ask for.

- Remote tier (L2, Redis): checked with a pipelined ``EXISTS`` on LMCache's keys for the prompt
  (``kvstore/tiers.py``), only when no GPU holds all but the last chunk of it (then the tiers cannot
  change the choice).
- Node CPU tiers (L1): estimated from the conversation's record (``router/residency.py``).
- Prefetch: ask the node's LMCache server to load the conversation's chain from Redis into its L1.

Advisory throughout: a tier that fails looks empty (counted), and the request goes on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import httpx

from kvgate.config import GatewaySettings
from kvgate.gateway.telemetry import GatewayMetrics
from kvgate.kvstore.tiers import LMCacheControl, RemoteTierProbe
from kvgate.router.residency import Residency
from kvgate.router.types import WorkerId


class TierView:
    def __init__(self, settings: GatewaySettings, client: httpx.AsyncClient, now: Callable[[], float],
                 wall: Callable[[], float], metrics: GatewayMetrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self.wall = wall
        """Residency times are stored in the shared record: wall time."""
        self.remote = (RemoteTierProbe(settings.tier_redis_url, now, chunk_tokens=settings.tier_chunk_tokens,
                                       timeout_s=settings.tier_probe_timeout_s, retry_s=settings.tier_retry_s)
                       if settings.tier_redis_url else None)
        self.lmcache = {w.id: LMCacheControl(w.lmcache_url, client, now, retry_s=settings.tier_retry_s)
                        for w in settings.workers if w.lmcache_url}

    async def tier_tokens(self, model: str, residency: Residency, tokens: Sequence[int] | None,
                          best_gpu_tokens: int, cache_salt: str | None = None) -> tuple[dict[str, int], int]:
        """(CPU-tier tokens per node, remote-tier tokens) of the prompt. ``cache_salt``: the request's;
        LMCache keys a salted chunk apart, so only the caller's own salt is probed."""
        if self.remote is None or tokens is None:
            return {}, 0
        if best_gpu_tokens >= len(tokens) - self.settings.tier_chunk_tokens:
            return {}, 0
        remote = await self.remote.prefix_tokens(self.model_path(model), tokens, cache_salt)
        self.metrics.tier_lookups.labels("remote", "up" if self.remote.breaker.up else "down").inc()
        return residency.cpu_tokens(remote, self.wall(), self.settings.cpu_tier_ttl_s), remote

    def stored(self, residency: Residency, node: str, tokens: int) -> Residency:
        """The worker's node stores what it computed (LMCache store-on-compute)."""
        return residency.stored(node, tokens, self.wall(), self.settings.cpu_tier_ttl_s,
                                self.settings.tier_chunk_tokens)

    def prefetchable(self, worker: WorkerId) -> bool:
        return worker in self.lmcache

    async def prefetch(self, model: str, worker: WorkerId, tokens: Sequence[int], cache_salt: str | None = None
                       ) -> bool:
        ctl = self.lmcache.get(worker)
        if ctl is None or not tokens:
            return False
        rid = await ctl.prefetch(self.model_path(model), tokens, cache_salt or "")
        self.metrics.prefetches.labels("submitted" if rid else "failed").inc()
        return bool(rid)

    def model_path(self, model: str) -> str:
        for w in self.settings.workers:
            if w.model == model and w.lmcache_model:
                return w.lmcache_model
        return model

    def snapshot(self) -> dict[str, Any]:
        r = self.remote
        return {"remote_tier": None if r is None else {"up": r.breaker.up, "errors": r.breaker.errors,
                                                       "lookups": r.lookups},
                "lmcache": {w: {"up": c.breaker.up, "errors": c.breaker.errors, "prefetches": c.prefetches}
                            for w, c in self.lmcache.items()}}

    async def aclose(self) -> None:
        if self.remote is not None:
            await self.remote.aclose()
