"""Drives ``EngineCore`` in (possibly sped-up) real time and hands each request its tokens."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from kvgate.clock import Clock
from kvgate.sim.blockpool import KVEvent
from kvgate.sim.engine import EngineCore, SimRequest, TokenOutput

log = logging.getLogger(__name__)


class EngineRunner:
    def __init__(self, core: EngineCore, clock: Clock,
                 on_events: Callable[[list[KVEvent]], None] | None = None) -> None:
        self.core = core
        self.clock = clock
        self._on_events = on_events
        self._queues: dict[str, asyncio.Queue[TokenOutput]] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.aborted = 0

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="sim-engine")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def submit(self, req: SimRequest) -> asyncio.Queue[TokenOutput]:
        q: asyncio.Queue[TokenOutput] = asyncio.Queue()
        req.arrival = self.clock.now()
        self.core.add_request(req)
        self._queues[req.id] = q
        self._wake.set()
        return q

    def abort(self, req_id: str) -> None:
        if self.core.abort(req_id):
            self.aborted += 1
        self._queues.pop(req_id, None)

    def _publish(self) -> None:
        events = self.core.take_events()
        if events and self._on_events is not None:
            try:
                self._on_events(events)
            except Exception:  # a broken publisher must not stop the engine
                log.exception("KV event publisher failed")

    async def _loop(self) -> None:
        while True:
            if not self.core.has_work():
                self._wake.clear()
                await self._wake.wait()
                continue
            plan = self.core.schedule()
            self._publish()  # evictions happen at scheduling time
            if not plan.scheduled and plan.duration_ms <= 0:
                # Nothing fits right now (memory); wait for a finish or an abort.
                self._wake.clear()
                await self._wake.wait()
                continue
            await self.clock.sleep(plan.duration_ms / 1000.0)
            outs = self.core.finish_step(plan, self.clock.now())
            self._publish()
            for out in outs:
                q = self._queues.get(out.request.id)
                if q is not None:
                    q.put_nowait(out)
                    if out.finished:
                        self._queues.pop(out.request.id, None)
            if any(o.finished for o in outs):
                self._wake.set()
