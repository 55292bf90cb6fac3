"""A fleet of simulated engines in virtual time, routed by kvgate's production policies.

The driver is a discrete-event loop over request arrivals and engine step completions; each engine is
``sim.engine.EngineCore`` (vLLM-style batching and prefix cache) and the router sees exactly what a
gateway would: its own in-flight accounting (pending prefill, decoding requests) and a prefix index fed
by the engines' KV events (``precise``, no event lag, as in Dynamo's replay) or by its own routing
history with a TTL (``approximate``).

A tiered fleet (``sim.tiers.FleetTiers``: a CPU tier per node and a shared pool) runs three more modes:
``round_robin_pool`` (round robin over engines that share only the pool: vLLM + Mooncake store),
``dynamo_credits`` (Dynamo's tier credits over kvgate's index) and ``kvgate_tiers`` (the cost model pricing
GPU hits, CPU-tier and pool loads and recompute). The last two see the tiers as a checked lookup would
(each node's L1 and the pool asked for the prompt's chunks), the same knowledge for both.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace

from kvgate.bench.trace import TraceRequest, TraceTokens
from kvgate.bench.waits import Wait, WaitTracker
from kvgate.router.approx import ApproxIndex
from kvgate.router.cost import CostModel, CostParams, Reuse
from kvgate.router.hashing import BlockHash
from kvgate.router.index import PrefixIndex
from kvgate.router.policies import Policy, PolicyParams, make_policy
from kvgate.router.types import ConversationId, FleetView, RouteRequest, WorkerId
from kvgate.sim.blockpool import KVEvent
from kvgate.sim.engine import SimRequest, StepPlan, make_core
from kvgate.sim.fleetcore import Accounting, apply_events, next_step
from kvgate.sim.tiers import EngineTiers, FleetTiers, TierPool, chunk_keys
from kvgate.sim.timing import TimingProfile

TIERED_MODES = ("round_robin_pool", "dynamo_credits", "kvgate_tiers")
MODES = ("round_robin", "least_loaded", "session_affinity", "kvgate_precise", "kvgate_approx", *TIERED_MODES)
_POLICY = {"round_robin_pool": "round_robin", "dynamo_credits": "dynamo_credits", "kvgate_tiers": "cost_model",
           "kvgate_precise": "cost_model", "kvgate_approx": "cost_model"}
_EVENTS = ("kvgate_precise", "dynamo_credits", "kvgate_tiers")
"""Modes whose router reads kvgate's KV-event index."""


def pool_only(t: FleetTiers, n_workers: int) -> FleetTiers:
    """The round-robin + shared-pool fleet: no L1, the nodes' L1 memory added to the pool (the same host
    memory, all of it given to the Mooncake store)."""
    nodes = len({t.node_of(i) for i in range(n_workers)})
    pool = None if t.pool_tokens is None else t.pool_tokens + nodes * t.cpu_tokens_per_node
    return replace(t, cpu_tokens_per_node=0, pool_tokens=pool)


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
    wait: Wait | None = None
    """Where the time to first token went (``trace_waits``)."""


class FleetSim:
    def __init__(self, n_workers: int, profile: TimingProfile, mode: str, *,
                 cost: CostParams | None = None, approx_ttl_s: float = 120.0, hash_seed: str = "0",
                 trace_waits: bool = False, engine: str = "vllm", tiers: FleetTiers | None = None) -> None:
        """``engine``: the workers are simulated vLLM or SGLang engines (their prefix caches, page
        identities and KV events); ``tiers``: the tiered fleet of the tiered modes (their default:
        ``FleetTiers()``; the other modes have GPU KV only)."""
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; expected one of {MODES}")
        self.profile = profile
        self.mode = mode
        spec = (tiers or FleetTiers()) if mode in TIERED_MODES else None
        if spec is not None and mode == "round_robin_pool":
            spec = pool_only(spec, n_workers)
        self.tier_spec = spec
        self.l1: dict[str, TierPool] = {}
        self.pool: TierPool | None = None
        tiers_of: list[EngineTiers | None] = [None] * n_workers
        if spec is not None:
            self.l1, pool = spec.pools(n_workers)
            self.pool = pool
            tiers_of = [spec.engine_tiers(i, self.l1, pool) for i in range(n_workers)]
        self.engines = [make_core(engine, profile, hash_seed=hash_seed, tiers=t) for t in tiers_of]
        self.nodes = [spec.node_of(i) if spec is not None else "" for i in range(n_workers)]
        self.hasher = self.engines[0].hasher
        self.event_int = self.engines[0].kind.event_int
        self.ids = [WorkerId(f"w{i}") for i in range(n_workers)]
        self.acct = [Accounting() for _ in range(n_workers)]
        self.index = PrefixIndex()
        self.approx = ApproxIndex(approx_ttl_s)
        if cost is None and spec is not None:
            cost = profile.cost_params(kv_bytes_per_token=spec.kv_bytes_per_token, cpu_load_gbps=spec.cpu_gbps,
                                       remote_load_gbps=spec.pool_gbps, remote_rtt_ms=spec.pool_rtt_ms
                                       ).model_copy(update={"tier_loads": "async" if spec.async_loads else "sync"})
        self.cost = CostModel(cost or profile.cost_params())
        """The cost model's load times, for the router's estimate of each worker's transfer backlog."""
        self.policy: Policy = make_policy(_POLICY.get(mode, mode), PolicyParams(cost=self.cost.params))
        self.home: dict[str, WorkerId] = {}
        self.tokens = TraceTokens(self.hasher)
        self.route_wall_s = 0.0
        self.reasons: Counter[str] = Counter()
        self.forgone_tokens = 0
        """Cached tokens some worker held that the chosen one did not (routing chose load over prefix)."""
        self.waits = WaitTracker(n_workers) if trace_waits else None

    # -- routing -----------------------------------------------------------------------------------
    def _tier_view(self, block_hashes: list[BlockHash]) -> tuple[dict[str, int], int]:
        """The prompt's prefix in each node's L1 and in the pool, in tokens (the tier-aware modes)."""
        if self.mode not in ("dynamo_credits", "kvgate_tiers") or self.tier_spec is None or self.pool is None:
            return {}, 0
        per = self.tier_spec.chunk_tokens
        keys = chunk_keys(block_hashes, self.profile.block_size, per)
        return {n: p.leading(keys) * per for n, p in self.l1.items()}, self.pool.leading(keys) * per

    def _route(self, r: TraceRequest, hashes: list[int], now: float, block_hashes: list[BlockHash] | None = None
               ) -> tuple[int, int, float | None]:
        t0 = time.perf_counter()
        matched: dict[WorkerId, int] = {}
        if self.mode in _EVENTS:
            matched = self.index.match(hashes)
        elif self.mode == "kvgate_approx":
            matched = self.approx.match(hashes, now)
        cpu, remote = self._tier_view(block_hashes or [])
        views = tuple(a.view(wid, node=node, load_backlog_ms=a.load_backlog_ms(now))
                      for wid, a, node in zip(self.ids, self.acct, self.nodes, strict=True))
        key = r.conversation_key
        req = RouteRequest("m", ConversationId(key), self.home.get(key), prompt_tokens=r.input_length,
                           matched_blocks=matched, block_size=self.profile.block_size, cpu_tokens=cpu,
                           remote_tokens=remote)
        d = self.policy.pick(req, FleetView(views))
        assert d is not None, "every simulated worker is healthy"
        self.reasons[d.reason] += 1
        if matched:
            best = min(max(matched.values()) * self.profile.block_size, (r.input_length - 1) // self.profile.block_size
                       * self.profile.block_size)
            self.forgone_tokens += max(0, best - d.expected_cached_tokens)
        self.home[key] = d.worker
        remote = d.expected_remote_tokens
        self.acct[self.ids.index(d.worker)].loading(
            self.cost.load_ms(Reuse(0, d.expected_loaded_tokens - remote, remote)), now)
        if self.mode == "kvgate_approx":
            self.approx.record(d.worker, hashes, now)
        self.route_wall_s += time.perf_counter() - t0
        return self.ids.index(d.worker), d.expected_cached_tokens, d.scores.get(d.worker)

    # -- events from the engines -------------------------------------------------------------------
    def _apply_events(self, w: int, events: list[KVEvent]) -> None:
        if events and self.mode in _EVENTS:
            apply_events(self.index, self.ids[w], events, self.event_int)

    # -- the loop ----------------------------------------------------------------------------------
    def _arrive(self, r: TraceRequest, now: float, results: dict[str, Result], mine: dict[str, int]) -> int:
        bh = self.tokens.block_hashes(r)
        t0 = time.perf_counter()
        w, expected, predicted = self._route(r, [self.event_int(h) for h in bh], now, bh)
        route_s = time.perf_counter() - t0
        rid = str(r.id)
        sr = SimRequest(rid, self.tokens.tokens(r), [0] * r.output_length, arrival=now)
        sr.hashes = list(bh)
        self.engines[w].add_request(sr)
        mine[rid] = max(1, r.input_length - expected)
        self.acct[w].acquire(mine[rid])
        results[rid] = Result(r.id, w, now, r.input_length, r.output_length, expected, route_s,
                              predicted if self.mode.startswith("kvgate") else None)
        if self.waits is not None:
            self.waits.arrived(w, rid, now)
        return w

    def _finish(self, w: int, plan: StepPlan, now: float, results: dict[str, Result], mine: dict[str, int]) -> None:
        core = self.engines[w]
        if self.waits is not None:
            self.waits.step_done(w, plan, self.profile, now)
        outs = core.finish_step(plan, now)
        self._apply_events(w, core.take_events())
        a = self.acct[w]
        for o in outs:
            res = results[o.request.id]
            if res.first_token is None:
                res.first_token = now
                res.cached = o.request.num_cached_tokens
                a.first_token(mine[o.request.id], res.prompt)
                if self.waits is not None:
                    res.wait = self.waits.first_token(w, o.request.id)
            if o.finished:
                res.finish = now
                a.release(context_tokens=res.prompt, got_first_token=True)

    def run(self, trace: Sequence[TraceRequest]) -> list[Result]:
        """Replay ``trace``. Each instant is settled as Dynamo's replay settles it: the steps that end
        then complete first, then every request arriving then is routed, then each idle worker starts
        its next step, so requests with the same timestamp share an idle worker's first step."""
        arrivals = sorted(trace, key=lambda r: (r.arrival_s, r.id))
        nxt = 0  # next arrival
        heap: list[tuple[float, int, int, StepPlan | None]] = []  # (time, seq, worker, plan | None=burst)
        seq = 0
        busy = [False] * len(self.engines)
        results: dict[str, Result] = {}
        mine: dict[str, int] = {}
        while heap or nxt < len(arrivals):
            now = min(heap[0][0] if heap else math.inf, arrivals[nxt].arrival_s if nxt < len(arrivals) else math.inf)
            touched: set[int] = set()
            while heap and heap[0][0] <= now:
                _, _, w, plan = heapq.heappop(heap)
                if plan is not None:
                    self._finish(w, plan, now, results, mine)
                busy[w] = False
                touched.add(w)
            while nxt < len(arrivals) and arrivals[nxt].arrival_s <= now:
                touched.add(self._arrive(arrivals[nxt], now, results, mine))
                nxt += 1
            # Pure-decode stretches run as one event, up to the next arrival (which may come here).
            horizon = (arrivals[nxt].arrival_s - now) * 1000.0 if nxt < len(arrivals) else math.inf
            for w in sorted(touched):
                if busy[w]:
                    continue
                core = self.engines[w]
                step = next_step(core, horizon)
                self._apply_events(w, core.take_events())
                if step is not None:
                    busy[w] = True
                    seq += 1
                    heapq.heappush(heap, (now + step[0] / 1000.0, seq, w, step[1]))
                    if self.waits is not None and step[1] is not None:
                        self.waits.step_started(w, now)
        return sorted(results.values(), key=lambda x: x.id)
