"""What happens to a session's KV between its requests: the gateway side of the lifecycle and tiers.

- On a request: the lifecycle moves to ``generating``; a tool wait that just ended is measured and
  fed back to the predictor; the session's reservation is released; the tiers are asked how much of
  the prompt they hold.
- On a response: ``awaiting_tool`` (with a plan: reserve the KV on the home worker, or release it and
  prefetch it into the node's LMCache L1 shortly before the predicted resume) or ``awaiting_user``
  (background prefill of the canonical branch is ``gateway/background_prefill.py``'s).

Everything here is advisory: a prediction or prefetch that fails is counted and logged, and the user's
request goes on as if tiers were empty.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

import httpx

from kvgate.clock import Clock
from kvgate.config import GatewaySettings
from kvgate.gateway.lifecycle import Event, Lifecycle, State
from kvgate.gateway.telemetry import GatewayMetrics
from kvgate.gateway.workers import WorkerPool
from kvgate.kvstore.tiers import LMCacheControl, RemoteTierProbe
from kvgate.router.residency import TierResidency
from kvgate.router.types import WorkerId
from kvgate.router.waits import WaitPredictor

log = logging.getLogger(__name__)


class TierKeeper:
    def __init__(self, settings: GatewaySettings, pool: WorkerPool, client: httpx.AsyncClient, clock: Clock,
                 metrics: GatewayMetrics, wall: Callable[[], float] | None = None,
                 chain_tokens: Callable[[str], tuple[int, ...] | None] = lambda _: None) -> None:
        self.settings = settings
        self.pool = pool
        self.client = client
        self.clock = clock
        self.metrics = metrics
        self.wall = wall or clock.now
        """Times stored in the shared session (wait start, plan deadlines): wall time, so that another
        gateway replica, or this one after a restart, measures the same wait."""
        self.predictor = WaitPredictor(settings.waits)
        self.residency = TierResidency(settings.cpu_tier_ttl_s, settings.tier_chunk_tokens, settings.max_sessions)
        self.remote = (RemoteTierProbe(settings.tier_redis_url, clock.now, chunk_tokens=settings.tier_chunk_tokens,
                                       timeout_s=settings.tier_probe_timeout_s, retry_s=settings.tier_retry_s)
                       if settings.tier_redis_url else None)
        self.lmcache = {w.id: LMCacheControl(w.lmcache_url, client, clock.now, retry_s=settings.tier_retry_s)
                        for w in settings.workers if w.lmcache_url}
        self.chain_tokens = chain_tokens
        """The conversation's cached chain (what a prefetch warms)."""
        self._reserved: dict[str, tuple[WorkerId, int]] = {}
        self._timers: dict[str, dict[str, asyncio.Task[None]]] = {}
        """Conversation -> kind (lapse, prefetch) -> its pending timer."""
        self._observed: OrderedDict[str, float] = OrderedDict()
        """Conversation -> start of the last wait fed back (a retried request must not count it twice)."""

    # -- a request arrives ---------------------------------------------------------------------
    def arrived(self, conversation: str, tenant: str, life: Lifecycle) -> Lifecycle:
        """Apply the request to the lifecycle; returns the new lifecycle."""
        now = self.wall()
        waited = now - life.since
        if life.state is State.AWAITING_TOOL and life.plan is not None and waited >= 0 \
                and self._observed.get(conversation) != life.since:
            self._observed[conversation] = life.since
            self._observed.move_to_end(conversation)
            while len(self._observed) > self.settings.max_sessions:
                self._observed.popitem(last=False)
            over = self.predictor.observe(tenant, life.tools, waited, life.plan.predicted_s)
            self.metrics.tool_waits.labels("overrun" if over else "within").inc()
        self._unreserve(conversation)
        for t in self._timers.pop(conversation, {}).values():
            t.cancel()
        return life.on(Event.REQUEST, now)

    async def tier_tokens(self, model: str, conversation: str, tokens: tuple[int, ...] | None,
                          best_gpu_tokens: int) -> tuple[dict[str, int], int]:
        """(CPU-tier tokens per node, remote-tier tokens) of the prompt. Asked only when no GPU holds
        all but the last chunk of it: then the tiers cannot change the choice."""
        if self.remote is None or tokens is None:
            return {}, 0
        if best_gpu_tokens >= len(tokens) - self.settings.tier_chunk_tokens:
            return {}, 0
        path = self._model_path(model)
        remote = await self.remote.prefix_tokens(path, tokens)
        self.metrics.tier_lookups.labels("remote", "up" if self.remote.breaker.up else "down").inc()
        return self.residency.cpu_tokens(conversation, remote, self.clock.now()), remote

    def routed(self, conversation: str, worker: WorkerId, prompt_tokens: int) -> None:
        node = self.pool.get(worker).config.node or worker
        self.residency.stored(conversation, node, prompt_tokens, self.clock.now())

    # -- a response ended ----------------------------------------------------------------------
    def completed(self, conversation: str, tenant: str, model: str, life: Lifecycle, worker: WorkerId,
                  tools: tuple[str, ...], kv_tokens: int) -> Lifecycle:
        now = self.wall()
        if tools:
            plan = self.predictor.plan(tenant, tools, now)
            life = life.on(Event.TOOL_CALLS, now, tools=tools, plan=plan)
            self.metrics.wait_plans.labels(plan.action).inc()
            if plan.action == "reserve":
                self._reserve(conversation, worker, kv_tokens, plan.deadline - now)
            elif plan.prefetch_at is not None and worker in self.lmcache:
                self._later(conversation, "prefetch", plan.prefetch_at - now,
                            lambda: self._prefetch(conversation, model, worker))
            return life
        return life.on(Event.ANSWER, now)

    def _reserve(self, conversation: str, worker: WorkerId, tokens: int, hold_s: float) -> None:
        self._unreserve(conversation)
        self._reserved[conversation] = (worker, tokens)
        self.pool.reserve(worker, tokens)

        async def lapse() -> None:
            self._unreserve(conversation)
            self.metrics.tool_waits.labels("reservation_lapsed").inc()

        self._later(conversation, "lapse", hold_s, lapse)

    def _unreserve(self, conversation: str) -> None:
        r = self._reserved.pop(conversation, None)
        if r is not None:
            self.pool.reserve(r[0], -r[1])

    def _later(self, conversation: str, kind: str, delay_s: float, work: Callable[[], Awaitable[None]]) -> None:
        """Run ``work`` after ``delay_s`` unless the conversation's next request comes first (one timer
        per conversation and kind: a new one replaces the old)."""
        timers = self._timers.setdefault(conversation, {})
        old = timers.pop(kind, None)
        if old is not None:
            old.cancel()

        async def run() -> None:
            try:
                await self.clock.sleep(max(0.0, delay_s))
                await work()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # advisory work: never let it escape
                log.warning("deferred tier work for %s failed: %r", conversation, exc)
            finally:
                mine = self._timers.get(conversation, {})
                if mine.get(kind) is task:
                    del mine[kind]
                    if not mine:
                        self._timers.pop(conversation, None)

        task = asyncio.get_running_loop().create_task(run(), name=f"tier:{kind}:{conversation}")
        timers[kind] = task

    # -- prefetch --------------------------------------------------------------------------------
    async def _prefetch(self, conversation: str, model: str, worker: WorkerId) -> None:
        ctl = self.lmcache[worker]
        tokens = self.chain_tokens(conversation)
        if not tokens:
            return
        rid = await ctl.prefetch(self._model_path(model), tokens)
        self.metrics.prefetches.labels("submitted" if rid else "failed").inc()
        if rid:
            node = self.pool.get(worker).config.node or worker
            self.residency.prefetched(conversation, node, len(tokens), self.clock.now())

    def _model_path(self, model: str) -> str:
        for w in self.settings.workers:
            if w.model == model and w.lmcache_model:
                return w.lmcache_model
        return model

    def snapshot(self) -> dict[str, Any]:
        return {"waits": self.predictor.snapshot(), "reserved": {c: [w, n] for c, (w, n) in self._reserved.items()},
                "remote_tier": None if self.remote is None else {"up": self.remote.breaker.up,
                                                                 "errors": self.remote.breaker.errors,
                                                                 "lookups": self.remote.lookups},
                "lmcache": {w: {"up": c.breaker.up, "errors": c.breaker.errors, "prefetches": c.prefetches}
                            for w, c in self.lmcache.items()}}

    async def aclose(self) -> None:
        tasks = [t for d in self._timers.values() for t in d.values()]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        if self.remote is not None:
            await self.remote.aclose()
