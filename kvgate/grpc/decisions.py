"""The live stream of routing decisions (``Routing.WatchDecisions``).

The router tells ``DecisionBus`` of every decision it makes for a real request, synchronously and on
the request's path, so that costs one length check while nobody watches. Each watcher has its own
bounded queue: a watcher that reads slower than decisions are made loses the oldest (counted, and
told in its next event) instead of growing the gateway's memory or slowing requests down.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Callable

from kvgate.gateway.exchange import Prepared
from kvgate.grpc.gen.kvgate.v1 import routing_pb2 as pb
from kvgate.router.types import Decision

MAX_WATCHERS = 64
QUEUE = 1024
"""Events one watcher may have unread (each a few hundred bytes)."""


class TooManyWatchers(Exception):
    pass


class Watch:
    def __init__(self, flt: pb.WatchDecisionsRequest, size: int) -> None:
        self.filter = flt
        self._items: deque[pb.DecisionEvent] = deque()
        self._size = size
        self._ready = asyncio.Event()
        self.dropped = 0

    def wants(self, p: Prepared) -> bool:
        f = self.filter
        return ((not f.model or f.model == p.model) and (not f.tenant or f.tenant == p.ident.tenant)
                and (not f.conversation_id or f.conversation_id == p.ident.conversation_id))

    def push(self, ev: pb.DecisionEvent) -> None:
        if len(self._items) >= self._size:
            self._items.popleft()
            self.dropped += 1
        self._items.append(ev)
        self._ready.set()

    async def events(self) -> AsyncIterator[pb.DecisionEvent]:
        while True:
            await self._ready.wait()
            self._ready.clear()
            while self._items:
                ev = self._items.popleft()
                if self.dropped:
                    ev.dropped, self.dropped = self.dropped, 0
                yield ev


class DecisionBus:
    def __init__(self, decision_pb: Callable[[Decision], pb.Decision], queue: int = QUEUE,
                 max_watchers: int = MAX_WATCHERS) -> None:
        self._decision_pb = decision_pb
        self._queue = queue
        self._max = max_watchers
        self._watches: set[Watch] = set()

    def __call__(self, p: Prepared, d: Decision, front: str, attempt: int) -> None:
        """A router listener (``Router.listeners``)."""
        if not self._watches:
            return
        base: pb.DecisionEvent | None = None
        for w in self._watches:
            if not w.wants(p):
                continue
            if base is None:
                base = pb.DecisionEvent(
                    time=time.time(), front=front, model=p.model, conversation_id=p.ident.conversation_id,
                    tenant=p.ident.tenant, attempt=attempt, decision=self._decision_pb(d),
                    endpoint=pb.ENDPOINT_COMPLETIONS if p.endpoint == "completions" else pb.ENDPOINT_CHAT,
                    prompt_tokens=p.prompt.length)
            ev = pb.DecisionEvent()
            ev.CopyFrom(base)
            if w.filter.include_scores:
                ev.scores.update({str(k): v for k, v in d.scores.items()})
            w.push(ev)

    def open(self, flt: pb.WatchDecisionsRequest) -> Watch:
        if len(self._watches) >= self._max:
            raise TooManyWatchers(f"at most {self._max} decision watchers at once")
        w = Watch(flt, self._queue)
        self._watches.add(w)
        return w

    def close(self, w: Watch) -> None:
        self._watches.discard(w)

    @property
    def watchers(self) -> int:
        return len(self._watches)
