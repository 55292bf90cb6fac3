"""What kvgate knows of every worker's cache: the KV-event-fed index for workers that publish events,
the approximate index (what kvgate routed there, with a TTL) for the others.

Each worker is matched with the prompt's hashes for its own hash identity (``HashSpec``: block size,
algorithm, seed). Matches are returned in blocks of the fleet's common unit (the gcd of its block sizes,
which is the block size itself in a fleet configured alike), each capped at what that worker's engine
can reuse (whole blocks below the prompt's last token), so one ``block_size`` serves the whole decision.

Prompts in flight count too: a request dispatched to a worker that publishes events is assumed cached
there (a speculative entry, as Dynamo's router does) until its blocks arrive by events, nothing kvgate
sent there is in flight any more, or ``inflight_ttl_s`` passes — so concurrent first turns sharing a
system prompt see each other instead of all expecting a cold worker.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from kvgate.gateway.prompts import Prompt
from kvgate.router.approx import ApproxIndex
from kvgate.router.hashing import HashSpec
from kvgate.router.index import PrefixIndex
from kvgate.router.kvevents import KvEventState
from kvgate.router.residency import hicache_host_tokens
from kvgate.router.types import WorkerId, WorkerView

SpecOf = Callable[[WorkerId], HashSpec | None]
SpecsOf = Callable[[str], Sequence[HashSpec]]


class PrefixKnowledge:
    def __init__(self, spec_of: SpecOf, specs_of: SpecsOf, approx_ttl_s: float, inflight_ttl_s: float = 30.0,
                 capacity_tokens: Callable[[WorkerId], int] | None = None) -> None:
        """``capacity_tokens``: a worker's KV capacity (0: unknown); the approximate indexes hold no more
        of a worker's blocks than it can."""
        self.index = PrefixIndex()
        self.events = KvEventState(self.index, on_stored=self._arrived)

        def blocks(w: WorkerId) -> int:
            spec = spec_of(w)
            return capacity_tokens(w) // spec.block_size if capacity_tokens is not None and spec is not None else 0

        self.approx = ApproxIndex(approx_ttl_s, blocks)
        self.inflight = ApproxIndex(inflight_ttl_s, blocks)
        self._spec_of = spec_of
        self._specs_of = specs_of
        self._approx_spec: dict[WorkerId, HashSpec] = {}
        self.on_routed: Callable[[WorkerId, HashSpec, list[int]], None] | None = None
        """Told the blocks routed to a worker without events that it has not been told of in the last
        quarter of the TTL (``gateway/routedsync.py`` shares them with the other replicas)."""

    def block_size(self, model: str) -> int:
        """The unit ``match`` counts in: the gcd of the model's workers' block sizes."""
        return math.gcd(*(s.block_size for s in self._specs_of(model))) or 16

    def precise(self, wid: WorkerId) -> bool:
        return self.events.follows(wid)

    def match(self, model: str, prompt: Prompt, workers: Sequence[WorkerView], now: float) -> dict[WorkerId, int]:
        """Longest cached prefix of ``prompt`` per worker, in blocks of ``block_size(model)``."""
        if not prompt.hashes:
            return {}
        unit = self.block_size(model)
        self.approx.expire(now)
        self.inflight.expire(now)
        out: dict[WorkerId, int] = {}
        for w in workers:
            spec = self._spec_of(w.id)
            hashes = prompt.hashes.get(spec) if spec is not None else None
            if spec is None or not hashes:
                continue
            depth = self._precise_depth(w, hashes) if self.precise(w.id) else self._approx_depth(w.id, spec, hashes)
            tokens = min(depth * spec.block_size, (prompt.length - 1) // spec.block_size * spec.block_size)
            if tokens >= unit:
                out[w.id] = tokens // unit
        return out

    def host_tokens(self, prompt: Prompt, workers: Sequence[WorkerView]) -> dict[str, int]:
        """Per worker id, the prompt's prefix in that worker's own CPU tier as its KV events tell it
        (``CPU_PINNED``/``CPU`` medium: SGLang's HiCache host pool, vLLM's native CPU offload), in tokens.
        A worker-local tier, unlike LMCache's per-node L1 that ``TierView`` estimates."""
        out: dict[str, int] = {}
        for w in workers:
            spec = self._spec_of(w.id)
            hashes = prompt.hashes.get(spec) if spec is not None else None
            if spec is None or not hashes or not self.precise(w.id) or self.events.stale(w.id):
                continue
            host = hicache_host_tokens(self.index, {w.id: hashes}, {w.id: spec.block_size}).get(str(w.id), 0)
            if host:
                out[str(w.id)] = host
        return out

    def _precise_depth(self, w: WorkerView, hashes: Sequence[int]) -> int:
        if self.events.stale(w.id):
            return 0
        depth = self.index.match(hashes, workers=(w.id,)).get(w.id, 0)
        if w.in_flight == 0 and self.inflight.holds(w.id):
            self.inflight.drop_worker(w.id)  # every request kvgate sent there has ended
        elif depth < len(hashes):
            depth = max(depth, self.inflight.index.match(hashes, workers=(w.id,)).get(w.id, 0))
        return depth

    def _approx_depth(self, wid: WorkerId, spec: HashSpec, hashes: Sequence[int]) -> int:
        self._check_spec(wid, spec)
        return self.approx.index.match(hashes, workers=(wid,)).get(wid, 0)

    def _check_spec(self, wid: WorkerId, spec: HashSpec) -> None:
        if self._approx_spec.get(wid, spec) != spec:
            # The worker's hashing changed (learned from it): what was recorded is in the old hashes.
            self.approx.drop_worker(wid)
        self._approx_spec[wid] = spec

    def _arrived(self, wid: WorkerId, hashes: tuple[int, ...]) -> None:
        self.inflight.forget(wid, hashes)

    def worker_restarted(self, wid: WorkerId) -> None:
        """The worker restarted or came back after being out: its cache may be empty, so nothing kvgate
        believed it held is expected there until its events say so again (the subscriber resyncs them)."""
        self.events.mark_stale(wid)
        self.index.clear(wid)
        self.approx.drop_worker(wid)
        self.inflight.drop_worker(wid)

    def worker_left(self, wid: WorkerId) -> None:
        """The worker is gone from the fleet: nothing is kept of it."""
        self.events.remove_worker(wid)
        self.approx.drop_worker(wid)
        self.inflight.drop_worker(wid)
        self._approx_spec.pop(wid, None)

    def holds(self, wid: WorkerId, block: int) -> bool:
        """Whether kvgate believes ``wid`` holds ``block`` (by its events, in flight there, or routed there)."""
        if self.precise(wid):
            return not self.events.stale(wid) and (self.index.holds(wid, block)
                                                   or self.inflight.index.holds(wid, block))
        return self.approx.index.holds(wid, block)

    def _hashes(self, wid: WorkerId, prompt: Prompt) -> tuple[HashSpec, tuple[int, ...]] | None:
        spec = self._spec_of(wid)
        hashes = prompt.hashes.get(spec) if spec is not None else None
        return (spec, hashes) if spec is not None and hashes else None

    def dispatched(self, model: str, wid: WorkerId, prompt: Prompt, now: float) -> None:
        """A request is being sent to ``wid``: its prompt counts there while it is in flight."""
        got = self._hashes(wid, prompt)
        if got is not None and self.precise(wid):
            self.inflight.record(wid, got[1], now)

    def routed(self, model: str, wid: WorkerId, prompt: Prompt, now: float) -> None:
        """The worker accepted the request: without events, what kvgate routed is all it knows."""
        got = self._hashes(wid, prompt)
        if got is not None and not self.precise(wid):
            self._check_spec(wid, got[0])
            if self.on_routed is not None:
                # A block published lately is already known to the others: republished only when its
                # shared time would lag by more than a quarter of the TTL, not on every turn of its chain.
                new = self.approx.stale(wid, got[1], now + self.approx.ttl_s * 0.75)
                if new:
                    self.on_routed(wid, got[0], new)
            self.approx.record(wid, got[1], now)

    def approx_spec(self, wid: WorkerId) -> HashSpec | None:
        """The hash identity of a worker kvgate knows only by what it routed (None: it has events)."""
        return None if self.precise(wid) else self._spec_of(wid)

    def merge_routed(self, wid: WorkerId, spec: HashSpec, entries: Sequence[tuple[int, float]]) -> int:
        """Blocks other replicas routed to ``wid`` (hash, when on this clock); returns how many were new."""
        if self.precise(wid) or self._spec_of(wid) != spec:
            return 0  # it publishes events now, or its hashing changed since that read
        self._check_spec(wid, spec)
        return self.approx.merge(wid, entries)
