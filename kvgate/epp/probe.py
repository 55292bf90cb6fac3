"""What a stream's reported 5xx may do to the fleet: ask kvgate to look for itself, sooner.

Envoy's response phases are claims of whoever holds the ext_proc stream; a forged ``:status: 503`` must
not take a worker out for everyone. So a reported 502/503/504 never feeds the worker's health; it asks
for an early active check (``WorkerPool.check``: ``/health`` and ``/metrics`` over kvgate's own
connection), and that check's result is the evidence. At most one check per worker in flight and one
per ``EARLY_PROBE_EVERY_S``, so a flood of claims costs each worker one ``/health`` a second."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from typing import TYPE_CHECKING

from kvgate.router.types import WorkerId

if TYPE_CHECKING:
    from kvgate.gateway.parts import Parts

log = logging.getLogger(__name__)

EARLY_PROBE_EVERY_S = 1.0
_KEPT = 1024
"""Workers whose last early check is remembered; older entries are dropped (a departed worker's)."""


class EarlyProbe:
    def __init__(self, gw: Parts) -> None:
        self.gw = gw
        self._tasks: dict[WorkerId, asyncio.Task[None]] = {}
        self._last: dict[WorkerId, float] = {}
        self.started = 0
        """Early checks started (the claims that asked for one beyond that were absorbed)."""

    def request(self, wid: WorkerId) -> None:
        if wid in self._tasks:
            return
        now = self.gw.clock.now()
        last = self._last.get(wid)
        if last is not None and now - last < EARLY_PROBE_EVERY_S:
            return
        try:
            w = self.gw.pool.get(wid)
        except KeyError:
            return
        if len(self._last) >= _KEPT:
            self._last = {k: t for k, t in self._last.items() if now - t < EARLY_PROBE_EVERY_S}
        self._last[wid] = now
        self.started += 1
        task = asyncio.get_running_loop().create_task(self.gw.pool.check(w), name=f"epp-early-probe-{wid}")
        self._tasks[wid] = task
        task.add_done_callback(functools.partial(self._done, wid))

    def _done(self, wid: WorkerId, task: asyncio.Task[None]) -> None:
        self._tasks.pop(wid, None)
        if not task.cancelled() and task.exception() is not None:
            log.debug("early check of %s failed to run: %r", wid, task.exception())

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
