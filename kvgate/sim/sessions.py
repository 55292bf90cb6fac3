"""Agent sessions on a simulated fleet in virtual time, routed by kvgate's cost model and orchestrated by
kvgate's session controller: the agent benchmark (``bench/agentfleet.py``, sessions from a generated
workload) and ``kvgate tune`` (sessions from a gateway's request log) both run here.

Closed loop: each session sends its next request when its previous response has ended plus the wait
its source says (a tool's run time or a user's think time). What happens to a session's KV between
requests is decided by the very controller the gateway runs (``session/controller.py``): this module
only executes its commands on simulated engines in virtual time, as ``gateway/runtime.py`` executes
them with asyncio, httpx and Redis. A ``Setup`` says what the fleet has:

- ``tiers``: engines store every computed chunk to their node's CPU tier and the shared remote tier and
  load from them on a miss (LMCache); ``tier_routing``: the router also sees tier residency (the keys
  kvgate computes, checked against each tier) and prices loads.
- ``plan_waits``: the controller predicts tool waits online, reserves the KV of short ones on the home
  worker (the router prices what evicting it would cost) and releases long ones, with a prefetch
  before the predicted resume when there are tiers.
- ``prefill`` (``PrefillParams.enabled``): background prefill of the canonical branch when a turn ends,
  at the engine's lowest priority.

A source gives each request's prompt as tokens (the fleet hashes them, reusing the session's chain) or
as block hashes (a log; its tokens are placeholders of the right length).
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvgate.router.cost import CostModel, CostParams, Reuse
from kvgate.router.hashing import BlockHash, VllmHasher, event_int
from kvgate.router.index import PrefixIndex
from kvgate.router.policies import Policy, make_policy
from kvgate.router.residency import Residency
from kvgate.router.types import ConversationId, FleetView, RouteRequest, WorkerId
from kvgate.sequences import common_prefix
from kvgate.session.controller import (
    ArmTimer,
    CancelPrefill,
    Command,
    ComputePrefix,
    ControllerParams,
    Count,
    IssuePrefill,
    Observe,
    Prefetch,
    Reserve,
    SessionController,
    Unreserve,
)
from kvgate.session.prefill import ContinueStats, PrefillParams, PrefillStats
from kvgate.session.state import Learned, SessionState
from kvgate.session.waits import WaitParams, WaitPredictor
from kvgate.sim.engine import EngineCore, SimRequest, StepPlan
from kvgate.sim.fleetcore import Accounting, apply_events, next_step
from kvgate.sim.sessiontypes import SessionSource, Setup, TierConfig, TurnResult
from kvgate.sim.tiers import EngineTiers, TierPool, chunk_keys
from kvgate.sim.timing import TimingProfile

MAX_BURST_MS = 50.0
CPU_TIER_TTL_S = 300.0


@dataclass(slots=True)
class _Session:
    src: SessionSource
    next_round: int = 0
    chain: list[int] = field(default_factory=list)
    chain_hashes: list[BlockHash] = field(default_factory=list)
    home: int | None = None
    state: SessionState = field(default_factory=SessionState)
    """The controller's state of this conversation (what the gateway keeps in its record)."""
    residency: Residency = field(default_factory=Residency)
    prefills: dict[int, SimRequest] = field(default_factory=dict)
    """Background prefills in flight, by the controller's token."""

    @property
    def tenant(self) -> str:
        return self.src.tenant


@dataclass(frozen=True, slots=True)
class _Step:
    worker: int
    plan: StepPlan | None
    """None: a decode burst."""


@dataclass(frozen=True, slots=True)
class _Timer:
    session: _Session
    kind: str
    token: int


class SessionFleet:
    def __init__(self, profile: TimingProfile, n_workers: int, workers_per_node: int, setup: Setup, *,
                 prefill: bool = False, tiers: TierConfig | None = None, waits: WaitParams | None = None,
                 prefill_params: PrefillParams | None = None, continues: ContinueStats | None = None,
                 hash_seed: str = "0", cost: CostParams | None = None, cpu_tier_ttl_s: float = CPU_TIER_TTL_S,
                 hidden_tokens: int = 0) -> None:
        self.profile = profile
        self.hidden_tokens = hidden_tokens
        """Output tokens no client sees (a reasoning parser's ``<think>``): the first visible output comes
        this many decode steps after the first token, as a gateway measures TTFT."""
        self.setup = setup
        self.cpu_tier_ttl_s = cpu_tier_ttl_s
        self.tiercfg = tc = tiers or TierConfig()
        self.hasher = VllmHasher(profile.block_size, "sha256", hash_seed)
        self.nodes = [f"node{i // workers_per_node}" for i in range(n_workers)]
        self.ids = [WorkerId(f"w{i}") for i in range(n_workers)]
        self.cpu = {n: TierPool(f"cpu:{n}", tc.cpu_tokens_per_node // tc.chunk_tokens) for n in set(self.nodes)}
        self.remote = TierPool("remote", None if tc.remote_tokens is None else tc.remote_tokens // tc.chunk_tokens)
        self.engines = [
            EngineCore(profile, self.hasher, tiers=None if not setup.tiers else EngineTiers(
                self.cpu[self.nodes[i]] if setup.l1 else None, self.remote, tc.chunk_tokens, tc.kv_bytes_per_token,
                tc.cpu_gbps, tc.remote_gbps, tc.remote_rtt_ms, async_loads=tc.async_loads))
            for i in range(n_workers)]
        self.index = PrefixIndex()
        self.max_model_len = (profile.num_blocks - 1) * profile.block_size
        params: CostParams = cost or profile.cost_params(
            kv_bytes_per_token=tc.kv_bytes_per_token, cpu_load_gbps=tc.cpu_gbps, remote_load_gbps=tc.remote_gbps,
            remote_rtt_ms=tc.remote_rtt_ms).model_copy(update={"tier_loads": "async" if tc.async_loads else "sync"})
        self.policy = CostModel(params)
        """The cost model: the controller prices prefills with it, and it routes unless ``setup.policy``
        names a reference policy."""
        self.router: Policy = self.policy if setup.policy == "cost_model" else make_policy(setup.policy)
        pp = (prefill_params or PrefillParams()).model_copy(update={"enabled": prefill})
        self.controller = SessionController(ControllerParams(pp, plan_waits=setup.plan_waits))
        self.learned = Learned(waits, pp)
        if continues is not None:
            self.learned.continues = continues
        self.counts: dict[tuple[str, str], float] = defaultdict(float)
        self.reserved = [0] * n_workers
        self.acct = [Accounting() for _ in range(n_workers)]
        self.reserved_samples: list[int] = []
        self.parked_token_s = 0.0
        """KV kept reserved for sessions waiting on tools, integrated over time (tokens x seconds)."""
        self._parked: dict[int, tuple[float, int]] = {}
        self.now = 0.0
        self.bg_computed = 0
        self._heap: list[tuple[float, int, str, object]] = []
        self._timers: list[float] = []
        """Times of the pending non-engine events, for the decode-burst horizon."""
        self._seq = 0
        self._busy = [False] * n_workers
        self._by_req: dict[str, tuple[_Session, TurnResult | None]] = {}
        self._mine: dict[str, int] = {}
        self._results: list[TurnResult] = []

    # -- what the benchmark reads ------------------------------------------------------------------
    @property
    def predictor(self) -> WaitPredictor:
        return self.learned.waits

    @property
    def continues(self) -> ContinueStats:
        return self.learned.continues

    @property
    def prefill_stats(self) -> PrefillStats:
        c = self.counts
        return PrefillStats({lab: int(n) for (name, lab), n in c.items() if name == "prefill_decisions"},
                            int(c["prefills", "issued"]), int(c["prefills", "completed"]), int(c["prefills", "failed"]),
                            int(c["prefills", "used"]), int(c["prefills", "wasted"]), int(c["prefills", "skipped"]),
                            c["prefill_saved_ms", ""])

    # -- what kvgate knows -------------------------------------------------------------------------
    def _chunk_keys(self, hashes: list[BlockHash]) -> list[BlockHash]:
        return chunk_keys(hashes, self.profile.block_size, self.tiercfg.chunk_tokens)

    def _views(self) -> FleetView:
        cap = self.profile.num_blocks * self.profile.block_size
        return FleetView(tuple(
            self.acct[i].view(wid, kv_usage=self.engines[i].pool.usage(),
                              reserved_tokens=self.reserved[i] if self.setup.plan_waits else 0,
                              kv_capacity_tokens=cap, node=self.nodes[i],
                              load_backlog_ms=self.acct[i].load_backlog_ms(self.now))
            for i, wid in enumerate(self.ids)))

    def _route(self, s: _Session, prompt: int, hashes: list[BlockHash]) -> tuple[int, int]:
        ints = [event_int(h) for h in hashes]
        matched = self.index.match(ints)
        cpu: dict[str, int] = {}
        remote = 0
        if self.setup.tier_routing:
            # Remote: checked (Redis EXISTS on the keys); CPU: kvgate's estimate, capped by the remote answer.
            remote = self.remote.leading(self._chunk_keys(hashes)) * self.tiercfg.chunk_tokens
            cpu = s.residency.cpu_tokens(remote, self.now, self.cpu_tier_ttl_s)
        req = RouteRequest("m", ConversationId(s.src.id), self.ids[s.home] if s.home is not None else None,
                           prompt_tokens=prompt, matched_blocks=matched, block_size=self.profile.block_size,
                           cpu_tokens=cpu, remote_tokens=remote)
        d = self.router.pick(req, self._views())
        assert d is not None
        w = self.ids.index(d.worker)
        remote = d.expected_remote_tokens
        self.acct[w].loading(self.policy.load_ms(Reuse(0, d.expected_loaded_tokens - remote, remote)), self.now)
        return w, d.expected_cached_tokens

    def _hashes(self, s: _Session, tokens: list[int], common: int | None = None) -> tuple[list[BlockHash], int]:
        """Block hashes of ``tokens``, reusing the session's chain hashes over the common prefix, and the
        tokens in common with the chain."""
        bs = self.profile.block_size
        if common is None:
            common = common_prefix(s.chain, tokens)
        lo = min(len(s.chain_hashes), common // bs, len(tokens) // bs)
        head = s.chain_hashes[:lo]
        return head + self.hasher.block_hashes(tokens[lo * bs:], parent=head[-1] if head else None,
                                               start_block=lo), common

    # -- the event loop ----------------------------------------------------------------------------
    def _push(self, t: float, kind: str, payload: object) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, kind, payload))
        if kind not in ("step", "burst"):
            heapq.heappush(self._timers, t)

    def _kick(self, w: int) -> None:
        if self._busy[w]:
            return
        core = self.engines[w]
        # Decode runs in bursts up to the next known arrival, at most MAX_BURST_MS: an arrival created
        # during a burst (a tool wait shorter than what is left of it) waits for the burst's end.
        horizon = min(MAX_BURST_MS, (self._timers[0] - self.now) * 1000.0 if self._timers else float("inf"))
        step = next_step(core, horizon)
        apply_events(self.index, self.ids[w], core.take_events())
        self._busy[w] = step is not None
        if step is not None:
            ms, plan = step
            self._push(self.now + ms / 1000.0, "burst" if plan is None else "step", _Step(w, plan))

    def run(self, sources: Sequence[SessionSource]) -> list[TurnResult]:
        for src in sources:
            if src.rounds():
                self._push(src.start_s, "arrive", _Session(src))
        while self._heap:
            now, _, kind, payload = heapq.heappop(self._heap)
            self.now = now
            if kind not in ("step", "burst"):
                heapq.heappop(self._timers)
            if isinstance(payload, _Session):
                self._arrive(payload)
            elif isinstance(payload, _Timer):
                s = payload.session
                step = self.controller.fired(s.state, kind=payload.kind, token=payload.token,
                                             home=self.ids[s.home] if s.home is not None else None)
                s.state = step.state
                self._execute(s, step.commands)
            elif isinstance(payload, _Step):
                self._step_done(payload)
        stuck = [r for r in self._results if r.finish is None]
        if stuck or any(e.has_work() for e in self.engines if any(not q.background for q in e.waiting)):
            raise RuntimeError(f"{len(stuck)} requests never finished (a prompt larger than a worker's KV?)")
        for since, tokens in self._parked.values():
            self.parked_token_s += tokens * (self.now - since)
        self._parked.clear()
        return self._results

    def _step_done(self, st: _Step) -> None:
        w = st.worker
        self._busy[w] = False
        if st.plan is not None:
            outs = self.engines[w].finish_step(st.plan, self.now)
            apply_events(self.index, self.ids[w], self.engines[w].take_events())
            for o in outs:
                if o.request.generated == 1:
                    self._first_token(o.request, w)
                if o.finished:
                    self._finished(o.request, w)
        self._kick(w)

    # -- a session's requests ----------------------------------------------------------------------
    def _arrive(self, s: _Session) -> None:
        i = s.next_round
        step = self.controller.arrived(s.state, tenant=s.tenant, now=self.now,
                                       user_turn=s.src.kind(i) == "user" and i > 0)
        s.state = step.state
        self._execute(s, step.commands)
        req = s.src.request(i, s.chain)
        tokens = req.tokens
        if len(tokens) + len(req.output) > self.max_model_len:
            # vLLM refuses to start with a max_model_len its KV cannot hold; a workload that needs more
            # is a configuration error, not a request to drop silently.
            raise ValueError(f"{s.src.id} needs {len(tokens) + len(req.output)} tokens; a worker holds "
                             f"{self.max_model_len}")
        if req.hashes is None:
            hashes, common = self._hashes(s, tokens)
        else:
            hashes, common = list(req.hashes), req.common
        gpu_home = 0
        if s.home is not None:
            held = self.index.match([event_int(h) for h in hashes]).get(self.ids[s.home], 0)
            gpu_home = held * self.profile.block_size
        if step.force is not None:
            # As the gateway does: the next request came first, so it goes where the prefill ran.
            w, expected = self.ids.index(step.force), 0
        else:
            w, expected = self._route(s, len(tokens), hashes)
        kind = "first" if i == 0 else s.src.kind(i)
        res = TurnResult(s.src.id, i, kind, s.src.heavy, w, self.now, len(tokens), len(tokens) - common, expected,
                         gpu_resident=gpu_home)
        self._results.append(res)
        rid = f"{s.src.id}/{i}"
        sr = SimRequest(rid, tokens, req.output, arrival=self.now)
        sr.hashes = [*hashes, *req.output_hashes]
        self._by_req[rid] = (s, res)
        self._mine[rid] = max(1, len(tokens) - expected)
        self.acct[w].acquire(self._mine[rid])
        s.home = w
        s.residency = s.residency.stored(self.nodes[w], len(tokens), self.now, self.cpu_tier_ttl_s,
                                         self.tiercfg.chunk_tokens)
        self.engines[w].add_request(sr)
        self._kick(w)

    def _first_token(self, sr: SimRequest, w: int) -> None:
        _, res = self._by_req[sr.id]
        if res is None:
            return
        res.first_token = sr.first_token_time
        if self.hidden_tokens and res.first_token is not None:
            core = self.engines[w]
            step = self.profile.decode_ms(len(core.running), sum(r.known_len for r in core.running))
            res.first_token += self.hidden_tokens * step / 1000.0
        res.reuse = sr.num_cached_tokens
        res.external = sr.external_tokens
        self.acct[w].first_token(self._mine[sr.id], res.prompt)

    def _finished(self, sr: SimRequest, w: int) -> None:
        s, res = self._by_req.pop(sr.id)
        if res is None:  # a background prefill
            self.bg_computed += len(sr.prompt) - max(0, sr.num_cached_tokens)
            token = next((t for t, q in s.prefills.items() if q is sr), None)
            if token is not None:
                del s.prefills[token]
                step = self.controller.prefill_done(s.state, token=token, ok=True)
                s.state = step.state
                self._execute(s, step.commands)
            return
        res.finish = self.now
        self.acct[w].release(context_tokens=res.prompt, got_first_token=True)
        s.chain = sr.prompt + sr.output
        s.chain_hashes = sr.hashes
        s.next_round += 1
        step = self.controller.ended(s.state, tenant=s.tenant, worker=self.ids[w], now=self.now,
                                     tools=s.src.tools(res.round), kv_tokens=len(s.chain), cached_tokens=res.reuse,
                                     learned=self.learned)
        s.state = step.state
        self._execute(s, step.commands)
        if s.next_round < s.src.rounds():
            self._push(self.now + s.src.wait_s(s.next_round), "arrive", s)

    # -- the controller's commands, in virtual time ------------------------------------------------
    def _execute(self, s: _Session, commands: tuple[Command, ...]) -> None:
        for c in commands:
            if isinstance(c, Count):
                self.counts[(c.name, c.label)] += c.amount
            elif isinstance(c, Observe):
                self.learned.apply(c.observation)  # one process: every observation is seen at once
            elif isinstance(c, ArmTimer):
                self._push(max(self.now, c.due), c.kind, _Timer(s, c.kind, c.token))
            elif isinstance(c, Reserve):
                self.reserved[self.ids.index(c.worker)] += c.tokens
                self.reserved_samples.append(c.tokens)
                self._parked[id(s)] = (self.now, c.tokens)
            elif isinstance(c, Unreserve):
                self.reserved[self.ids.index(c.worker)] -= c.tokens
                since, tokens = self._parked.pop(id(s), (self.now, 0))
                self.parked_token_s += tokens * (self.now - since)
            elif isinstance(c, Prefetch):
                self._prefetch(s)
            elif isinstance(c, ComputePrefix):
                self._compute_prefix(s, c)
            elif isinstance(c, CancelPrefill):
                sr = s.prefills.pop(c.token, None)
                if sr is not None:
                    self.engines[self.ids.index(c.worker)].abort(sr.id)
                    self._by_req.pop(sr.id, None)
            # CancelTimers: a cancelled timer fires with a token the state no longer holds (ignored).

    def _prefetch(self, s: _Session) -> None:
        """LMCache prefetch: the session's chunks that only the remote tier holds, into the home node's
        CPU tier."""
        assert s.home is not None
        tiers = self.engines[s.home].tiers
        if tiers is None:
            return
        tiers.prefetch(self._chunk_keys(s.chain_hashes))
        s.residency = s.residency.stored(self.nodes[s.home], len(s.chain), self.now, self.cpu_tier_ttl_s,
                                         self.tiercfg.chunk_tokens)

    def _compute_prefix(self, s: _Session, c: ComputePrefix) -> None:
        nxt = s.src.next_prefix(s.next_round - 1)
        prefix = nxt.tokens
        if nxt.hashes is None:
            divergence = common_prefix(s.chain, prefix)
        else:
            same = next((j for j, (a, b) in enumerate(zip(s.chain_hashes, nxt.hashes, strict=False)) if a != b),
                        min(len(s.chain_hashes), len(nxt.hashes)))
            divergence = same * self.profile.block_size
        w = self.ids.index(c.worker)
        step = self.controller.prefix_ready(
            s.state, token=c.token, worker=c.worker, divergence=divergence, prefix_tokens=len(prefix),
            block_size=self.profile.block_size, pending_requests=self.acct[w].pending_requests,
            kv_usage=self.engines[w].pool.usage(), cost=self.policy.params, learned=self.learned)
        s.state = step.state
        self._execute(s, tuple(x for x in step.commands if not isinstance(x, IssuePrefill)))
        for x in step.commands:
            if isinstance(x, IssuePrefill):
                sr = SimRequest(f"{s.src.id}/bg{s.next_round - 1}", prefix, [0], arrival=self.now, background=True)
                sr.hashes = list(nxt.hashes) if nxt.hashes is not None else self._hashes(s, prefix, divergence)[0]
                s.prefills[x.token] = sr
                self._by_req[sr.id] = (s, None)
                self.engines[w].add_request(sr)
                self._kick(w)
