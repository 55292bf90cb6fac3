"""Background prefill of the canonical branch, at run time: decide when a turn ends (the rule is
``gateway/prefill.py``), send the prefill, follow it to the next request, and count what it was worth.

A prefill is a ``/v1/completions`` request with the canonical prefix's token ids and ``max_tokens`` 1,
counted in the worker's queue like any request. The next request of the conversation settles it:
*used* when its cached tokens reach past the divergence point, *wasted* otherwise; if it arrives while
the prefill still runs, it goes to that worker and the prefill is cancelled (*skipped*: vLLM aborts it,
the blocks it finished stay cached). An answer with no user turn for ``settle_s`` counts as the
conversation's end (for the tenant's continuation rate) and settles its prefill as wasted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from kvgate.config import GatewaySettings
from kvgate.gateway.prefill import ContinueStats, PrefillStats, decide, gain_tokens
from kvgate.gateway.prompts import common_prefix
from kvgate.gateway.telemetry import GatewayMetrics
from kvgate.gateway.workers import WorkerPool
from kvgate.router.types import WorkerId

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Pending:
    worker: WorkerId
    divergence: int
    """Tokens of the prefilled prefix the cached chain already had: reuse beyond this is the prefill's."""
    gain_ms: float
    task: asyncio.Task[bool]


class BackgroundPrefill:
    def __init__(self, settings: GatewaySettings, pool: WorkerPool, client: httpx.AsyncClient,
                 metrics: GatewayMetrics, wall: Callable[[], float]) -> None:
        self.settings = settings
        self.pool = pool
        self.client = client
        self.metrics = metrics
        self.wall = wall
        self.stats = PrefillStats.new()
        self.continues = ContinueStats(settings.prefill)
        self._pending: OrderedDict[str, _Pending] = OrderedDict()
        self._answers: OrderedDict[str, tuple[str, int, float]] = OrderedDict()
        """Conversation -> (tenant, canonical prefix tokens, wall time) of its last answer, oldest first:
        the size its continuation is counted under, and when it counts as ended (``_sweep``)."""

    def arrived(self, conversation: str, tenant: str, next_user_turn: bool) -> WorkerId | None:
        """A request of the conversation arrived (``next_user_turn``: a new user message after an
        answer). Returns the worker it must go to when a prefill of its prefix still runs there."""
        self._sweep(self.wall())
        answer = self._answers.pop(conversation, None)
        if next_user_turn and answer is not None:
            self.continues.continued(tenant, answer[1])
        pending = self._pending.get(conversation)
        if pending is None or pending.task.done():
            return None
        pending.task.cancel()
        self.stats.skipped += 1
        self.metrics.prefills.labels("skipped").inc()
        return pending.worker

    def settle(self, conversation: str, cached_tokens: int | None) -> None:
        """The conversation's next request got its usage (None: it never will): was the prefill reused?"""
        p = self._pending.pop(conversation, None)
        if p is None:
            return
        if not p.task.done():
            p.task.cancel()
        if cached_tokens is not None and cached_tokens > p.divergence:
            self.stats.used += 1
            self.stats.saved_ms += p.gain_ms
            self.metrics.prefills.labels("used").inc()
        else:
            self.stats.wasted += 1
            self.metrics.prefills.labels("wasted").inc()

    def after_answer(self, conversation: str, tenant: str, model: str, worker: WorkerId,
                     chain: tuple[int, ...] | None, prefix: list[int] | None, block_size: int, p1_ms: float) -> str:
        """A turn ended on ``worker`` with the cached ``chain``; the next request will start with
        ``prefix``. Decides, and issues the prefill if the rule says so; returns the decision's reason."""
        params = self.settings.prefill
        if not params.enabled:
            return "disabled"
        if chain is None or prefix is None:
            self.metrics.prefill_decisions.labels("no_tokens").inc()
            return "no_tokens"
        now = self.wall()
        self._sweep(now)
        self._answers.pop(conversation, None)
        self._answers[conversation] = (tenant, len(prefix), now)  # at the end: the newest
        while len(self._answers) > self.settings.max_sessions:
            self._answers.popitem(last=False)
        w = self.pool.get(worker)
        divergence = common_prefix(chain, prefix)
        gain = gain_tokens(divergence, len(prefix), block_size)
        d = decide(params, gain, self.continues.p(tenant, len(prefix)), pending_requests=w.pending_requests,
                   kv_usage=w.kv_usage)
        self.stats.count(d)
        self.metrics.prefill_decisions.labels(d.reason).inc()
        if not d.issue:
            return d.reason
        self.settle(conversation, None)  # an older one nobody used
        task = asyncio.get_running_loop().create_task(self._send(model, worker, prefix), name=f"prefill:{conversation}")
        self._pending[conversation] = _Pending(worker, divergence, p1_ms * gain, task)
        self._pending.move_to_end(conversation)
        while len(self._pending) > self.settings.max_sessions:
            self.settle(next(iter(self._pending)), None)
        self.metrics.prefills.labels("issued").inc()
        return d.reason

    def _sweep(self, now: float) -> None:
        """Answers older than ``settle_s`` with no user turn since: those conversations ended and a
        prefill made for them was wasted. Swept on traffic, oldest first, instead of one sleeping task
        per conversation."""
        limit = now - self.settings.prefill.settle_s
        while self._answers:
            cid, (tenant, size, at) = next(iter(self._answers.items()))
            if at > limit:
                break
            del self._answers[cid]
            self.continues.ended(tenant, size)
            self.settle(cid, None)

    async def _send(self, model: str, worker: WorkerId, prefix: list[int]) -> bool:
        body: dict[str, Any] = {"model": model, "prompt": prefix, "max_tokens": 1, "temperature": 0}
        if self.settings.prefill_priority is not None:
            body["priority"] = self.settings.prefill_priority
        # Counted in the worker's queue like any request, so routing sees the work it adds.
        self.pool.acquire(worker, len(prefix))
        try:
            r = await self.client.post(f"{self.pool.get(worker).config.url}/v1/completions", json=body)
            ok = r.status_code == 200
        except httpx.HTTPError as exc:
            log.warning("background prefill failed: %r", exc)
            ok = False
        finally:
            self.pool.release(worker, len(prefix))
        self.stats.completed += ok
        self.stats.failed += not ok
        self.metrics.prefills.labels("completed" if ok else "failed").inc()
        return ok

    def snapshot(self) -> dict[str, Any]:
        self._sweep(self.wall())
        s = self.stats
        return {"issued": s.issued, "completed": s.completed, "failed": s.failed, "used": s.used,
                "wasted": s.wasted, "skipped": s.skipped, "saved_ms": round(s.saved_ms, 1),
                "decisions": dict(s.decided), "continuation": self.continues.snapshot()}

    async def aclose(self) -> None:
        tasks = [p.task for p in self._pending.values()]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
