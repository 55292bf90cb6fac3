"""The worker pool: configured workers, their health (active checks and passive marking), their load.

Active checks poll ``/health`` and the engine's ``/metrics`` every interval; a request that fails to
reach a worker marks it unhealthy at once (passive), and the next good check brings it back.
``snapshot()`` freezes what the router may read.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvgate.clock import Clock
from kvgate.config import WorkerConfig
from kvgate.router.types import FleetView, WorkerId, WorkerView

log = logging.getLogger(__name__)

# Engine metric names for (running, waiting, kv usage).
_LOAD_METRICS = {
    "vllm": ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"),
    "sim": ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"),
    "sglang": ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage"),
}


@dataclass(slots=True)
class WorkerState:
    config: WorkerConfig
    healthy: bool = False
    in_flight: int = 0
    pending_prefill: int = 0
    pending_requests: int = 0
    decode_requests: int = 0
    decode_tokens: int = 0
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    last_error: str = ""
    last_check: float = 0.0
    reserved: int = 0
    """KV tokens of sessions parked here on short tool waits (gateway/tiering.py)."""
    kv_capacity: int = 0
    """GPU KV capacity in tokens: configured, else ``vllm:cache_config_info`` (blocks x block size)."""

    @property
    def id(self) -> WorkerId:
        return WorkerId(self.config.id)

    def view(self) -> WorkerView:
        return WorkerView(self.id, self.config.model, self.healthy, self.in_flight, self.running,
                          self.waiting, self.kv_usage, self.pending_prefill, self.pending_requests,
                          self.decode_requests, self.decode_tokens, self.reserved,
                          self.config.kv_capacity_tokens or self.kv_capacity, self.config.node)


class WorkerPool:
    def __init__(self, workers: list[WorkerConfig], client: httpx.AsyncClient, clock: Clock,
                 interval_s: float = 5.0, timeout_s: float = 2.0) -> None:
        self._workers = {WorkerId(w.id): WorkerState(w) for w in workers}
        self._client = client
        self._clock = clock
        self._interval = interval_s
        self._timeout = timeout_s
        self._task: asyncio.Task[None] | None = None

    # -- reading -------------------------------------------------------------------------------
    def get(self, wid: WorkerId) -> WorkerState:
        return self._workers[wid]

    def all(self) -> list[WorkerState]:
        return list(self._workers.values())

    def models(self) -> list[str]:
        return sorted({w.config.model for w in self._workers.values()})

    def serves(self, model: str) -> bool:
        return any(w.config.model == model for w in self._workers.values())

    def snapshot(self, model: str) -> FleetView:
        return FleetView(tuple(w.view() for w in self._workers.values() if w.config.model == model))

    def ready(self) -> dict[str, bool]:
        """Per served model: is at least one of its workers healthy?"""
        out: dict[str, bool] = {}
        for w in self._workers.values():
            out[w.config.model] = out.get(w.config.model, False) or w.healthy
        return out

    # -- request accounting --------------------------------------------------------------------
    # What kvgate knows of each worker's queue is what it sent and what came back: a request is
    # "pending" (its uncached tokens wait for prefill) until its first token, then "decoding".
    def acquire(self, wid: WorkerId, prefill_tokens: int = 0) -> None:
        w = self._workers[wid]
        w.in_flight += 1
        w.pending_prefill += prefill_tokens
        w.pending_requests += 1

    def first_token(self, wid: WorkerId, prefill_tokens: int, context_tokens: int) -> None:
        w = self._workers[wid]
        w.pending_prefill = max(0, w.pending_prefill - prefill_tokens)
        w.pending_requests = max(0, w.pending_requests - 1)
        w.decode_requests += 1
        w.decode_tokens += context_tokens

    def release(self, wid: WorkerId, prefill_tokens: int = 0, context_tokens: int = 0,
                got_first_token: bool = False) -> None:
        w = self._workers[wid]
        w.in_flight = max(0, w.in_flight - 1)
        if got_first_token:
            w.decode_requests = max(0, w.decode_requests - 1)
            w.decode_tokens = max(0, w.decode_tokens - context_tokens)
        else:
            w.pending_prefill = max(0, w.pending_prefill - prefill_tokens)
            w.pending_requests = max(0, w.pending_requests - 1)

    def reserve(self, wid: WorkerId, tokens: int) -> None:
        w = self._workers.get(wid)
        if w is not None:
            w.reserved = max(0, w.reserved + tokens)

    def mark_failed(self, wid: WorkerId, error: str) -> None:
        w = self._workers[wid]
        if w.healthy:
            log.warning("worker %s marked unhealthy: %s", wid, error)
        w.healthy = False
        w.last_error = error

    # -- active checks -------------------------------------------------------------------------
    async def check(self, w: WorkerState) -> None:
        base = w.config.url
        try:
            r = await self._client.get(f"{base}/health", timeout=self._timeout)
            ok = r.status_code == 200
            if ok:
                await self._poll_load(w)
            if ok and not w.healthy:
                log.info("worker %s is healthy", w.id)
            w.healthy = ok
            w.last_error = "" if ok else f"/health answered {r.status_code}"
        except httpx.HTTPError as exc:
            if w.healthy:
                log.warning("worker %s failed its health check: %r", w.id, exc)
            w.healthy = False
            w.last_error = repr(exc)
        w.last_check = self._clock.now()

    async def _poll_load(self, w: WorkerState) -> None:
        names = _LOAD_METRICS.get(w.config.engine)
        if names is None:
            return
        try:
            r = await self._client.get(f"{w.config.url}/metrics", timeout=self._timeout)
            if r.status_code != 200:
                return
            values: dict[str, float] = {}
            for fam in text_string_to_metric_families(r.text):
                for sample in fam.samples:
                    if sample.name in names:
                        values[sample.name] = values.get(sample.name, 0.0) + sample.value
                    elif sample.name == "vllm:cache_config_info":
                        blocks, bs = sample.labels.get("num_gpu_blocks", ""), sample.labels.get("block_size", "")
                        if blocks.isdigit() and bs.isdigit():
                            w.kv_capacity = int(blocks) * int(bs)
        except (httpx.HTTPError, ValueError):
            return  # load is advisory; health decides eligibility
        def finite(v: float) -> float:
            return v if math.isfinite(v) else 0.0

        w.running = int(finite(values.get(names[0], 0.0)))
        w.waiting = int(finite(values.get(names[1], 0.0)))
        w.kv_usage = finite(values.get(names[2], 0.0))

    async def check_all(self) -> None:
        results = await asyncio.gather(*(self.check(w) for w in self._workers.values()), return_exceptions=True)
        for w, r in zip(self._workers.values(), results, strict=True):
            if isinstance(r, BaseException) and not isinstance(r, asyncio.CancelledError):
                # One worker's odd answer must not stop the checks that bring the others back.
                log.warning("health check of %s failed: %r", w.id, r)
                w.healthy = False

    async def _loop(self) -> None:
        while True:
            await self.check_all()
            await asyncio.sleep(self._interval)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="worker-health")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
