"""Workers that come and go: what a discovery source reports, turned into joins and leaves.

- A worker that joins is part of the fleet at once but takes no request until it has been
  subscribed to (its KV events replayed, bounded by ``sync_timeout_s``) and has passed a health check;
  a worker of a model kvgate has not served yet gets its tokenizer parity probe.
- A worker that leaves is drained: no new request, the ones in flight finish, then it is removed; its
  index entries are dropped at once. The conversations whose home it was pick a new home on their next
  request (the worker is no longer in the fleet the policy reads).
- Workers of the static list never leave; discovery adds to them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence

from kvgate.config import WorkerConfig
from kvgate.discovery import WorkerSource
from kvgate.gateway.kvevents import KvEventSubscriber
from kvgate.gateway.prefix import PrefixKnowledge
from kvgate.gateway.workers import WorkerPool
from kvgate.router.types import WorkerId
from kvgate.tasks import cancel_and_wait, stopping

log = logging.getLogger(__name__)


class Membership:
    def __init__(self, pool: WorkerPool, subscriber: KvEventSubscriber, prefix: PrefixKnowledge,
                 source: WorkerSource, sync_timeout_s: float = 5.0,
                 new_model: Callable[[str], Awaitable[object]] | None = None, retry_s: float = 5.0) -> None:
        self.pool = pool
        self.subscriber = subscriber
        self.prefix = prefix
        self.source = source
        self._sync_timeout = sync_timeout_s
        self._new_model = new_model
        self._static = {WorkerId(w.id) for w in pool.all()}
        self._managed: set[WorkerId] = set()
        self._in_progress: set[WorkerId] = set()
        self._retry_s = retry_s
        self._tasks: list[asyncio.Task[None]] = []
        self.joined = 0
        self.left = 0

    async def apply(self, configs: Sequence[WorkerConfig]) -> None:
        """Make the discovered part of the fleet equal to ``configs``; retry joins still pending."""
        want = {WorkerId(c.id): c for c in configs if WorkerId(c.id) not in self._static}
        current = {w.id: w for w in self.pool.all() if w.id in self._managed and not w.draining}
        for wid, c in want.items():
            if wid in current and current[wid].config != c:
                await self._update(c, current[wid].config)
        for wid in current:
            if wid not in want:
                await self._leave(wid)
        await asyncio.gather(*(self._join(c) for wid, c in want.items()
                               if wid not in current or current[wid].joining))

    async def _join(self, c: WorkerConfig) -> None:
        wid = WorkerId(c.id)
        if wid in self._in_progress:  # a round and the retry loop may both try it
            return
        self._in_progress.add(wid)
        try:
            await self._join_once(c, wid)
        finally:
            self._in_progress.discard(wid)

    async def _join_once(self, c: WorkerConfig, wid: WorkerId) -> None:
        new_model = not self.pool.serves(c.model)
        if wid in self._managed:
            w = self.pool.get(wid)
        else:
            w = self.pool.add(c)
            self._managed.add(wid)
            self.joined += 1
        await self.pool.check(w)
        if not w.health.eligible:
            log.info("worker %s found but not healthy yet (%s): no traffic until it is", wid, w.last_error)
            return  # still joining: retried on the source's next round
        if not self.subscriber.covers(wid) and await self.subscriber.subscribe(c):
            await self.subscriber.wait_synced(self._sync_timeout)
        if w.draining:  # left again while joining
            return
        self.pool.admit(wid)
        log.info("worker %s joined", wid)
        if new_model and self._new_model is not None:
            await self._new_model(c.model)

    async def _leave(self, wid: WorkerId) -> None:
        self.left += 1
        self._managed.discard(wid)
        self.pool.drain(wid)
        await self.subscriber.unsubscribe(wid)  # drops its event-fed index entries too
        self.prefix.worker_left(wid)

    async def _update(self, c: WorkerConfig, old: WorkerConfig) -> None:
        wid = WorkerId(c.id)
        self.pool.update(c)
        if (c.kv_events, c.kv_replay) != (old.kv_events, old.kv_replay):
            await self.subscriber.unsubscribe(wid)
            self.prefix.worker_left(wid)
            await self.subscriber.subscribe(c)

    async def start(self, first_timeout_s: float) -> None:
        """Start following the source; wait (bounded) for its first answer so the gateway serves with it."""
        first = asyncio.Event()
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._follow(first), name="discovery"),
                       loop.create_task(self._retry_joins(), name="discovery-joins")]
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(first.wait(), first_timeout_s)

    async def _follow(self, first: asyncio.Event) -> None:
        async for configs in self.source.watch():
            try:
                await self.apply(configs)
            except Exception:  # one bad round must not stop discovery for good
                log.exception("applying discovered workers failed")
            first.set()

    async def _retry_joins(self) -> None:
        """Workers found before they were healthy join as soon as they are (a source may not report again)."""
        while not stopping():
            await asyncio.sleep(self._retry_s)
            pending = [w.config for w in self.pool.all() if w.joining and w.id in self._managed]
            await asyncio.gather(*(self._join(c) for c in pending), return_exceptions=True)

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            await cancel_and_wait(t)
        self._tasks = []
