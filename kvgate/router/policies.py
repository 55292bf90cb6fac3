"""Routing policies behind one contract: ``pick(request, fleet) -> Decision | None``.

A policy never does I/O. ``None`` means no eligible worker (the gateway answers 503). Policies are
objects because some keep a tiny amount of private state (the round-robin cursor); they never read
anything that is not in their arguments.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvgate.router.cost import CostModel, CostParams
from kvgate.router.types import Decision, FleetView, RouteRequest, WorkerId, WorkerView


class Policy(Protocol):
    name: str

    def pick(self, request: RouteRequest, fleet: FleetView) -> Decision | None: ...


def _eligible(request: RouteRequest, fleet: FleetView) -> list[WorkerView]:
    return [w for w in fleet.healthy() if w.id not in request.exclude]


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self._cursor = 0

    def pick(self, request: RouteRequest, fleet: FleetView) -> Decision | None:
        workers = sorted(_eligible(request, fleet), key=lambda w: w.id)
        if not workers:
            return None
        w = workers[self._cursor % len(workers)]
        self._cursor += 1
        return Decision(worker=w.id, reason="rotation")


class LeastLoaded:
    name = "least_loaded"

    def pick(self, request: RouteRequest, fleet: FleetView) -> Decision | None:
        workers = _eligible(request, fleet)
        if not workers:
            return None
        # kvgate's own in-flight count first; the engine's queue (which also holds other clients'
        # requests) and KV usage break ties; then the id, so the choice is reproducible.
        scores = {w.id: float(w.in_flight) + w.waiting / 1000 + w.kv_usage / 1e6 for w in workers}
        best = min(workers, key=lambda w: (scores[w.id], w.id))
        return Decision(worker=best.id, reason="min_load", scores=scores)


def _h64(s: str) -> int:
    return int.from_bytes(hashlib.blake2b(s.encode(), digest_size=8).digest(), "big")


class HashRing:
    """Consistent hashing with virtual nodes: adding or removing one worker moves ~1/n of keys."""

    def __init__(self, workers: Sequence[WorkerId], vnodes: int = 64) -> None:
        points = sorted((_h64(f"{w}#{i}"), w) for w in set(workers) for i in range(vnodes))
        self._keys = [p[0] for p in points]
        self._owners = [p[1] for p in points]

    def walk(self, key: str) -> list[WorkerId]:
        """Distinct workers in ring order starting at the key's position."""
        if not self._keys:
            return []
        start = bisect.bisect(self._keys, _h64(key)) % len(self._keys)
        seen: list[WorkerId] = []
        n = len(self._keys)
        for i in range(n):
            w = self._owners[(start + i) % n]
            if w not in seen:
                seen.append(w)
        return seen


class SessionAffinity:
    """Consistent hashing with bounded load (Mirrokni et al.): sessions stick to a home worker.

    A conversation stays on its home worker (from the session store) unless that worker is unhealthy
    or above ``(1+epsilon)`` times the mean load; a new conversation takes the first worker on the
    ring, walking on past overloaded ones. The bound counts the request being placed.
    """

    name = "session_affinity"

    def __init__(self, epsilon: float = 0.25, vnodes: int = 64) -> None:
        if epsilon < 0:
            raise ValueError("epsilon must be >= 0")
        self.epsilon = epsilon
        self.vnodes = vnodes
        self._ring: HashRing | None = None
        self._ring_ids: tuple[WorkerId, ...] = ()

    def _ring_for(self, fleet: FleetView) -> HashRing:
        # The ring is built over ALL configured workers, healthy or not, so a worker's brief outage
        # does not reshuffle everyone else's sessions.
        ids = tuple(sorted(w.id for w in fleet.workers))
        if self._ring is None or ids != self._ring_ids:
            self._ring = HashRing(ids, self.vnodes)
            self._ring_ids = ids
        return self._ring

    def _cap(self, workers: Sequence[WorkerView]) -> float:
        total = sum(w.load for w in workers) + 1
        return math.ceil((1 + self.epsilon) * total / len(workers))

    def pick(self, request: RouteRequest, fleet: FleetView) -> Decision | None:
        workers = _eligible(request, fleet)
        if not workers:
            return None
        by_id = {w.id: w for w in workers}
        cap = self._cap(workers)
        scores = {w.id: float(w.load) for w in workers}
        home = by_id.get(request.home_worker) if request.home_worker else None
        if home is not None and home.load + 1 <= cap:
            return Decision(worker=home.id, reason="sticky", scores=scores)
        order = [w for w in self._ring_for(fleet).walk(request.conversation_id) if w in by_id]
        for i, wid in enumerate(order):
            if by_id[wid].load + 1 <= cap:
                if request.home_worker is not None:
                    reason = "home_overloaded" if request.home_worker in by_id else "home_unavailable"
                else:
                    reason = "ring" if i == 0 else "ring_overflow"
                return Decision(worker=wid, reason=reason, scores=scores)
        # Unreachable in practice (the least-loaded worker is always under the cap), kept total.
        best = min(workers, key=lambda w: (w.load, w.id))
        return Decision(worker=best.id, reason="least_loaded_fallback", scores=scores)


@dataclass(frozen=True, slots=True)
class TierCredits:
    """Dynamo's KV router's overlap credits per tier (its ``--router-kv-overlap-score-credit``,
    ``--router-host-cache-hit-weight``, ``--router-disk-cache-hit-weight`` and the experimental
    shared-pool multiplier; defaults as documented for Dynamo 1.2–1.3) and ``--router-prefill-load-scale``."""

    gpu: float = 1.0
    host: float = 0.75
    disk: float = 0.25
    """kvgate's tiers have no disk tier; kept so the credits are Dynamo's whole set."""
    pool: float = 0.5
    prefill_load_scale: float = 1.0


class DynamoCredits:
    """Dynamo's KV router cost over kvgate's index and tier knowledge (a reference policy, not kvgate's)::

        overlap  = gpu · GPU-hit blocks + host · CPU-tier blocks + pool · shared-pool blocks
        prefill  = max(active prefill blocks + prompt blocks − overlap, 0)
        cost     = prefill_load_scale · prefill + active decode blocks + prompt blocks

    lowest cost wins (Dynamo's temperature 0). Its "active" blocks are the worker's requests in flight:
    here kvgate's accounting (pending prefill tokens, decoding context tokens). Ties, which Dynamo breaks
    at random, are broken by a hash of conversation and worker, so a run is reproducible and cold
    conversations still spread."""

    name = "dynamo_credits"

    def __init__(self, credits: TierCredits | None = None) -> None:
        self.credits = credits or TierCredits()
        self._split = CostModel(CostParams())  # only its tier split of a worker's reusable prefix

    def cost(self, request: RouteRequest, w: WorkerView) -> float:
        c, bs = self.credits, request.block_size
        r = self._split.reuse(request, w)
        overlap = (c.gpu * r.gpu + c.host * r.cpu + c.pool * r.remote) / bs
        blocks = -(-request.prompt_tokens // bs)
        prefill = max(w.pending_prefill_tokens / bs + blocks - overlap, 0.0)
        return c.prefill_load_scale * prefill + w.decode_tokens / bs + blocks

    def pick(self, request: RouteRequest, fleet: FleetView) -> Decision | None:
        workers = _eligible(request, fleet)
        if not workers:
            return None
        scores = {w.id: self.cost(request, w) for w in workers}
        best = min(workers, key=lambda w: (scores[w.id], _h64(f"{request.conversation_id}|{w.id}")))
        r = self._split.reuse(request, best)
        return Decision(worker=best.id, reason="dynamo_cost", expected_cached_tokens=r.total, scores=scores,
                        expected_loaded_tokens=r.cpu + r.remote, expected_remote_tokens=r.remote, tier=r.tier)


@dataclass(frozen=True, slots=True)
class PolicyParams:
    """What the policies are built from (the gateway's settings, or a benchmark's)."""

    affinity_epsilon: float = 0.25
    cost: CostParams = field(default_factory=CostParams)


POLICIES: dict[str, Callable[[PolicyParams], Policy]] = {
    "round_robin": lambda p: RoundRobin(),
    "least_loaded": lambda p: LeastLoaded(),
    "session_affinity": lambda p: SessionAffinity(p.affinity_epsilon),
    "cost_model": lambda p: CostModel(p.cost.model_copy()),
    "dynamo_credits": lambda p: DynamoCredits(),
}


def make_policy(name: str, params: PolicyParams | None = None) -> Policy:
    """The policy registered as ``name``; an unknown name fails here, at assembly, not per request."""
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; expected one of {sorted(POLICIES)}") from None
    return factory(params or PolicyParams())
