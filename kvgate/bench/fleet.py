"""A fleet of simulated engines in virtual time, routed by kvgate's production policies.

The driver is a discrete-event loop over request arrivals and engine step completions; each engine is
``sim.engine.EngineCore`` (vLLM-style batching and prefix cache) and the router sees exactly what a
gateway would: its own in-flight accounting (pending prefill, decoding requests) and a prefix index fed
by the engines' KV events (``precise``, no event lag, as in Dynamo's replay) or by its own routing
history with a TTL (``approximate``).
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvgate.bench.trace import TraceRequest, TraceTokens
from kvgate.router.approx import ApproxIndex
from kvgate.router.cost import CostModel, CostParams
from kvgate.router.hashing import VllmHasher, event_int
from kvgate.router.index import PrefixIndex
from kvgate.router.policies import Policy, make_policy
from kvgate.router.types import ConversationId, FleetView, RouteRequest, WorkerId, WorkerView
from kvgate.sim.blockpool import BlockRemoved, BlockStored, KVEvent
from kvgate.sim.engine import EngineCore, SimRequest, StepPlan
from kvgate.sim.timing import TimingProfile

MODES = ("round_robin", "least_loaded", "session_affinity", "kvgate_precise", "kvgate_approx")


@dataclass(slots=True)
class Result:
    id: int
    worker: int
    arrival: float
    prompt: int
    output: int
    expected_cached: int
    route_s: float
    predicted_ttft_ms: float | None = None
    cached: int = -1
    first_token: float | None = None
    finish: float | None = None


@dataclass(slots=True)
class Accounting:
    """What the gateway knows of one worker: only what it sent and what came back (``WorkerPool``'s
    accounting, for workers in virtual time)."""

    in_flight: int = 0
    pending_prefill: int = 0
    pending_requests: int = 0
    decode_requests: int = 0
    decode_tokens: int = 0

    def sent(self, prefill_tokens: int) -> None:
        self.in_flight += 1
        self.pending_prefill += prefill_tokens
        self.pending_requests += 1

    def first_token(self, prefill_tokens: int, context_tokens: int) -> None:
        self.pending_prefill -= prefill_tokens
        self.pending_requests -= 1
        self.decode_requests += 1
        self.decode_tokens += context_tokens

    def finished(self, context_tokens: int) -> None:
        self.in_flight -= 1
        self.decode_requests -= 1
        self.decode_tokens -= context_tokens

    def view(self, wid: WorkerId, **extra: Any) -> WorkerView:
        return WorkerView(wid, "m", True, self.in_flight, pending_prefill_tokens=self.pending_prefill,
                          pending_requests=self.pending_requests, decode_requests=self.decode_requests,
                          decode_tokens=self.decode_tokens, **extra)


def next_step(core: EngineCore, horizon_ms: float) -> tuple[float, StepPlan | None] | None:
    """An engine's next event in virtual time: (ms, None) for a stretch of pure decode run as one event
    (up to ``horizon_ms``), (ms, plan) for one scheduled step, None when it has nothing to run. The
    caller takes the KV events the step produced."""
    if not core.has_work():
        return None
    steps, ms = core.decode_burst(horizon_ms)
    if steps:
        return ms, None
    plan = core.schedule()
    return (plan.duration_ms, plan) if plan.scheduled else None


def apply_events(index: PrefixIndex, wid: WorkerId, events: list[KVEvent]) -> None:
    """A simulated engine's KV events into kvgate's index, applied directly (the wire format is covered
    by the engine tests)."""
    for ev in events:
        if isinstance(ev, BlockStored):
            index.store(wid, [event_int(h) for h in ev.block_hashes])
        elif isinstance(ev, BlockRemoved):
            index.remove(wid, [event_int(h) for h in ev.block_hashes])
        else:
            index.clear(wid)


class FleetSim:
    def __init__(self, n_workers: int, profile: TimingProfile, mode: str, *,
                 cost: CostParams | None = None, approx_ttl_s: float = 120.0, hash_seed: str = "0") -> None:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; expected one of {MODES}")
        self.profile = profile
        self.mode = mode
        self.hasher = VllmHasher(profile.block_size, "sha256", hash_seed)
        self.engines = [EngineCore(profile, self.hasher) for _ in range(n_workers)]
        self.ids = [WorkerId(f"w{i}") for i in range(n_workers)]
        self.acct = [Accounting() for _ in range(n_workers)]
        self.index = PrefixIndex()
        self.approx = ApproxIndex(approx_ttl_s)
        self.policy: Policy = (CostModel(cost or profile.cost_params()) if mode.startswith("kvgate")
                               else make_policy(mode))
        self.home: dict[str, WorkerId] = {}
        self.tokens = TraceTokens(self.hasher)
        self.route_wall_s = 0.0

    # -- routing -----------------------------------------------------------------------------------
    def _route(self, r: TraceRequest, hashes: list[int], now: float) -> tuple[int, int, float | None]:
        t0 = time.perf_counter()
        matched: dict[WorkerId, int] = {}
        if self.mode == "kvgate_precise":
            matched = self.index.match(hashes)
        elif self.mode == "kvgate_approx":
            matched = self.approx.match(hashes, now)
        views = tuple(a.view(wid) for wid, a in zip(self.ids, self.acct, strict=True))
        key = r.conversation_key
        req = RouteRequest("m", ConversationId(key), self.home.get(key), prompt_tokens=r.input_length,
                           matched_blocks=matched, block_size=self.profile.block_size)
        d = self.policy.pick(req, FleetView(views))
        assert d is not None, "every simulated worker is healthy"
        self.home[key] = d.worker
        if self.mode == "kvgate_approx":
            self.approx.record(d.worker, hashes, now)
        self.route_wall_s += time.perf_counter() - t0
        return self.ids.index(d.worker), d.expected_cached_tokens, d.scores.get(d.worker)

    # -- events from the engines -------------------------------------------------------------------
    def _apply_events(self, w: int, events: list[KVEvent]) -> None:
        if events and self.mode == "kvgate_precise":
            apply_events(self.index, self.ids[w], events)

    # -- the loop ----------------------------------------------------------------------------------
    def run(self, trace: Sequence[TraceRequest]) -> list[Result]:
        arrivals = sorted(trace, key=lambda r: (r.arrival_s, r.id))
        nxt = 0  # next arrival
        heap: list[tuple[float, int, int, StepPlan | None]] = []  # (time, seq, worker, plan | None=burst)
        seq = 0
        busy = [False] * len(self.engines)
        results: dict[str, Result] = {}
        mine: dict[str, int] = {}

        def start(w: int, now: float) -> None:
            nonlocal seq
            core = self.engines[w]
            # Pure-decode stretches run as one event, up to the next arrival (which may come here).
            horizon = (arrivals[nxt].arrival_s - now) * 1000.0 if nxt < len(arrivals) else float("inf")
            step = next_step(core, horizon)
            self._apply_events(w, core.take_events())
            busy[w] = step is not None
            if step is not None:
                seq += 1
                heapq.heappush(heap, (now + step[0] / 1000.0, seq, w, step[1]))

        while heap or nxt < len(arrivals):
            if nxt < len(arrivals) and (not heap or arrivals[nxt].arrival_s < heap[0][0]):
                r = arrivals[nxt]
                nxt += 1
                now = r.arrival_s
                bh = self.tokens.block_hashes(r)
                ints = [event_int(h) for h in bh]
                t0 = time.perf_counter()
                w, expected, predicted = self._route(r, ints, now)
                route_s = time.perf_counter() - t0
                rid = str(r.id)
                sr = SimRequest(rid, self.tokens.tokens(r), [0] * r.output_length, arrival=now)
                sr.hashes = list(bh)
                self.engines[w].add_request(sr)
                mine[rid] = max(1, r.input_length - expected)
                self.acct[w].sent(mine[rid])
                results[rid] = Result(r.id, w, now, r.input_length, r.output_length, expected, route_s,
                                      predicted if self.mode.startswith("kvgate") else None)
                if not busy[w]:
                    start(w, now)
                continue
            now, _, w, plan = heapq.heappop(heap)
            core = self.engines[w]
            if plan is not None:
                outs = core.finish_step(plan, now)
                self._apply_events(w, core.take_events())
                a = self.acct[w]
                for o in outs:
                    res = results[o.request.id]
                    if res.first_token is None:
                        res.first_token = now
                        res.cached = o.request.num_cached_tokens
                        a.first_token(mine[o.request.id], res.prompt)
                    if o.finished:
                        res.finish = now
                        a.finished(res.prompt)
            start(w, now)
        return sorted(results.values(), key=lambda x: x.id)
