"""What kvgate knows of the LMCache tiers when it routes, and what it asks of them.

- With LMCache's coordinator (``tier_coordinator_url``): its key directory says which LMCache instance's
  L1 and whether the shared L2 holds each chunk of the prompt (``kvstore/lmcache_coordinator.py``); an
  instance maps to the workers configured with its ``lmcache_instance``, and so to their node.
- Without it, or while it is down: L2 (Redis) is checked with a pipelined ``EXISTS`` on LMCache's keys
  (``kvstore/tiers.py``) and node L1 is estimated from the conversation's record (``router/residency.py``).
- Either is asked only when no GPU holds all but the last chunk of the prompt (then the tiers cannot
  change the choice).
- Prefetch: warm the routed worker's LMCache L1 from L2 (through the coordinator when it names the
  worker's instance, else the worker's LMCache server directly).
- Pins (coordinator only): a parked conversation's chain is pinned in L2 while its reservation holds
  (``gateway/runtime.py``: granted within the tenant's parked-KV budget) and unpinned when it ends.
- Load rates: the LMCache servers' own throughput histograms, scraped every ``tier_rates_interval_s``,
  set the cost model's ``cpu_load_gbps`` / ``remote_load_gbps`` — unless an operator pinned one
  (``PATCH /admin/policy``; ``gateway/policyedit.RatePins``, shared by every replica): a pin wins over
  what is learned, and learning sets the parameter again once the pin is cleared. Each parameter is
  the pin, else this replica's learned value, else the configured one, and says which (``rate_sources``).

Advisory throughout: a tier that fails looks empty (counted), and the request goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import Any

import httpx
from prometheus_client import Counter, Gauge

from kvgate.config import GatewaySettings
from kvgate.gateway.policyedit import LEARNED_RATES, RatePins
from kvgate.gateway.telemetry import GatewayMetrics
from kvgate.kvstore.lmcache_coordinator import LMCacheCoordinator
from kvgate.kvstore.tiers import LMCacheControl, RemoteTierProbe, TierOracle, TransferRates, scrape_rates
from kvgate.router.cost import CostModel, CostParams
from kvgate.router.residency import Residency
from kvgate.router.types import WorkerId

log = logging.getLogger(__name__)


class TierView:
    def __init__(self, settings: GatewaySettings, client: httpx.AsyncClient, now: Callable[[], float],
                 wall: Callable[[], float], metrics: GatewayMetrics, cost: CostModel | None = None) -> None:
        self.settings = settings
        self.metrics = metrics
        self.wall = wall
        """Residency times are stored in the shared record: wall time."""
        self.client = client
        self.remote = (RemoteTierProbe(settings.tier_redis_url, now, chunk_tokens=settings.tier_chunk_tokens,
                                       timeout_s=settings.tier_probe_timeout_s, retry_s=settings.tier_retry_s)
                       if settings.tier_redis_url else None)
        self.coordinator = (LMCacheCoordinator(settings.tier_coordinator_url, client, now,
                                               chunk_tokens=settings.tier_chunk_tokens, retry_s=settings.tier_retry_s)
                            if settings.tier_coordinator_url else None)
        self.oracles: list[tuple[str, TierOracle]] = [
            *((("coordinator", self.coordinator),) if self.coordinator is not None else ()),
            *((("remote", self.remote),) if self.remote is not None else ())]
        """Asked in order; the first that answers is used (a failing one answers as down)."""
        self.lmcache = {w.id: LMCacheControl(w.lmcache_url, client, now, retry_s=settings.tier_retry_s)
                        for w in settings.workers if w.lmcache_url}
        self.instance_of = {w.id: w.lmcache_instance for w in settings.workers if w.lmcache_instance}
        self.nodes_of: dict[str, set[str]] = {}
        """LMCache instance -> the keys ``RouteRequest.cpu_tokens`` prices its L1 under (node, else worker)."""
        for w in settings.workers:
            if w.lmcache_instance:
                self.nodes_of.setdefault(w.lmcache_instance, set()).add(w.node or w.id)
        self.cost = cost
        self.rates = TransferRates()
        self.pinned = RatePins()
        """The operator's values of the learned rates (the fleet's policy document, ``gateway/policysync.py``)."""
        self._learned: dict[str, float] = {}
        """What this replica learned of each rate, pinned or not (a cleared pin falls back to it at once)."""
        self._rates_task: asyncio.Task[None] | None = None
        r = metrics.registry
        self.pins = Counter("kvgate_tier_pins", "L2 pins asked of LMCache's coordinator, by operation (pin, "
                            "unpin) and outcome (done, failed).", ["op", "outcome"], registry=r)
        self.learned = Gauge("kvgate_tier_learned_load_gbps", "Tier load rates learned from LMCache's "
                             "throughput metrics (0: none yet), by tier (cpu, remote).", ["tier"], registry=r)

    async def start(self) -> None:
        """Check the coordinator's API (a mismatch raises: a misconfigured fleet, not an empty tier), and
        start learning the load rates."""
        if self.coordinator is not None:
            await self.coordinator.check(sorted({w.lmcache_url for w in self.settings.workers if w.lmcache_url}))
        if self.settings.tier_rates_interval_s is not None and self.lmcache and self.cost is not None:
            self._rates_task = asyncio.create_task(self._learn_rates(self.settings.tier_rates_interval_s),
                                                   name="kvgate-tier-rates")

    async def _learn_rates(self, every_s: float) -> None:
        urls = sorted({c.url for c in self.lmcache.values()})
        while True:
            with contextlib.suppress(Exception):  # advisory: a bad scrape keeps the last rates
                await self.refresh_rates(urls)
            await asyncio.sleep(every_s)

    async def refresh_rates(self, urls: Sequence[str] | None = None) -> None:
        await scrape_rates(self.rates, self.client, urls if urls is not None else sorted(
            {c.url for c in self.lmcache.values()}))
        cpu = self.rates.cpu.value
        if cpu is not None and cpu > 0:
            self._learned["cpu_load_gbps"] = cpu
        if self.cost is not None:
            self.cost.params = self.rated(self.cost.params)
        # The L2 leg in series with the L1 leg as the cost model prices it: pinned, else learned.
        remote = self.rates.remote_gbps(self._cpu_gbps())
        if remote is not None and remote > 0:
            self._learned["remote_load_gbps"] = remote
        if self.cost is not None:
            self.cost.params = self.rated(self.cost.params)
        self.learned.labels("cpu").set(cpu or 0.0)
        self.learned.labels("remote").set(remote or 0.0)

    def rated(self, params: CostParams) -> CostParams:
        """``params`` with each learned rate as the operator pinned it, else as learned here, else as
        configured (what another replica learned is not ours to use: each scrapes the servers itself)."""
        update = {}
        for k in LEARNED_RATES:
            pin = getattr(self.pinned, k)
            update[k] = pin if pin is not None else self._learned.get(k, getattr(self.settings.cost, k))
        return params.model_copy(update=update)

    def rate_sources(self) -> dict[str, str]:
        """Where each learned rate's value comes from now: ``operator``, ``learned`` or ``configured``."""
        return {k: "operator" if getattr(self.pinned, k) is not None else "learned" if k in self._learned
                else "configured" for k in LEARNED_RATES}

    async def tier_tokens(self, model: str, residency: Residency, tokens: Sequence[int] | None,
                          best_gpu_tokens: int, cache_salt: str | None = None) -> tuple[dict[str, int], int]:
        """(CPU-tier tokens per node, remote-tier tokens) of the prompt. ``cache_salt``: the request's;
        LMCache keys a salted chunk apart, so only the caller's own salt is asked for."""
        if tokens is None or not self.oracles:
            return {}, 0
        if best_gpu_tokens >= len(tokens) - self.settings.tier_chunk_tokens:
            return {}, 0
        path = self.model_path(model)
        for label, oracle in self.oracles:
            found = await oracle.residency(path, tokens, cache_salt)
            up = oracle.breaker.up
            self.metrics.tier_lookups.labels(label, "up" if up else "down").inc()
            if not up:
                continue  # the next oracle (the Redis probe) answers while the coordinator is down
            if found.l1 is None:
                return residency.cpu_tokens(found.l2, self.wall(), self.settings.cpu_tier_ttl_s), found.l2
            cpu: dict[str, int] = {}
            for inst, n in found.l1.items():
                for node in self.nodes_of.get(inst, ()):
                    cpu[node] = max(cpu.get(node, 0), n)
            return cpu, found.l2
        return {}, 0

    def stored(self, residency: Residency, node: str, tokens: int) -> Residency:
        """The worker's node stores what it computed (LMCache store-on-compute)."""
        return residency.stored(node, tokens, self.wall(), self.settings.cpu_tier_ttl_s,
                                self.settings.tier_chunk_tokens)

    def prefetchable(self, worker: WorkerId) -> bool:
        return worker in self.lmcache or (self.coordinator is not None and worker in self.instance_of)

    async def prefetch(self, model: str, worker: WorkerId, tokens: Sequence[int], cache_salt: str | None = None
                       ) -> bool:
        if not tokens:
            return False
        inst = self.instance_of.get(worker)
        if self.coordinator is not None and inst is not None:
            rid = await self.coordinator.prefetch(inst, self.model_path(model), tokens, cache_salt)
        else:
            ctl = self.lmcache.get(worker)
            if ctl is None:
                return False
            rid = await ctl.prefetch(self.model_path(model), tokens, cache_salt or "")
        self.metrics.prefetches.labels("submitted" if rid else "failed").inc()
        return bool(rid)

    async def pin(self, model: str, tokens: Sequence[int], cache_salt: str | None = None, *, unpin: bool = False
                  ) -> bool:
        """Pin (or unpin) the chain's chunks in L2 through the coordinator; False without one or on failure."""
        c = self.coordinator
        if c is None or len(tokens) < self.settings.tier_chunk_tokens:
            return False
        call = c.unpin if unpin else c.pin
        got = await call(self.model_path(model), tokens, cache_salt)
        self.pins.labels("unpin" if unpin else "pin", "done" if got is not None else "failed").inc()
        return got is not None

    def model_path(self, model: str) -> str:
        for w in self.settings.workers:
            if w.model == model and w.lmcache_model:
                return w.lmcache_model
        return model

    def snapshot(self) -> dict[str, Any]:
        r, c = self.remote, self.coordinator
        return {"remote_tier": None if r is None else {"up": r.breaker.up, "errors": r.breaker.errors,
                                                       "lookups": r.lookups},
                "coordinator": None if c is None else {"url": c.url, "up": c.breaker.up, "errors": c.breaker.errors,
                                                       "lookups": c.stats.lookups, "prefetches": c.stats.prefetches,
                                                       "pins": c.stats.pins, "unpins": c.stats.unpins},
                "lmcache": {w: {"up": x.breaker.up, "errors": x.breaker.errors, "prefetches": x.prefetches}
                            for w, x in self.lmcache.items()},
                "learned_rates": self.rates.snapshot(self._cpu_gbps()),
                "load_rates": {k: {"gbps": getattr(self.cost.params if self.cost is not None else self.settings.cost,
                                                   k), "source": src} for k, src in self.rate_sources().items()}}

    def _cpu_gbps(self) -> float:
        return self.cost.params.cpu_load_gbps if self.cost is not None else self.settings.cost.cpu_load_gbps

    async def aclose(self) -> None:
        if self._rates_task is not None:
            self._rates_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._rates_task
        if self.remote is not None:
            await self.remote.aclose()
        if self.coordinator is not None:
            await self.coordinator.aclose()
