"""Agent sessions on a simulated fleet with LMCache tiers, in virtual time, routed by kvgate's code.

Closed loop: each session (``bench/agents.py``) sends its next request when the previous response has
ended plus the scripted tool wait or think time. What each mode changes:

- ``no_tiering``: engines with GPU KV only; kvgate's cost model over the KV-event index.
- ``lmcache``: engines store every computed chunk to their node's CPU tier and the shared remote tier
  and load from them on a miss; kvgate routes as above, blind to the tiers (LMCache without kvgate's
  lifecycle).
- ``kvgate``: the router also sees tier residency (the keys kvgate computes, checked against each tier)
  and prices loads; tool waits are predicted online (``router/waits.py``); short waits reserve their
  KV on the home worker, long ones release it and prefetch it from the remote tier into the node's CPU
  tier before the predicted resume.
- ``+prefill`` (a flag on any mode): background prefill of the canonical branch when a turn ends
  (``gateway/prefill.py``'s rule), at the engine's lowest priority.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field

from kvgate.bench.agents import SessionScript, canonical_history, next_turn_prefix
from kvgate.bench.fleet import Accounting, apply_events, next_step
from kvgate.gateway.lifecycle import Event, Lifecycle, State
from kvgate.gateway.prefill import ContinueStats, PrefillParams, PrefillStats, decide, gain_tokens
from kvgate.gateway.prompts import common_prefix
from kvgate.router.cost import CostModel, CostParams
from kvgate.router.hashing import BlockHash, VllmHasher, event_int
from kvgate.router.index import PrefixIndex
from kvgate.router.residency import TierResidency
from kvgate.router.types import ConversationId, FleetView, RouteRequest, WorkerId
from kvgate.router.waits import WaitParams, WaitPlan, WaitPredictor
from kvgate.sim.blockpool import KVEvent
from kvgate.sim.engine import EngineCore, SimRequest, StepPlan
from kvgate.sim.tiers import EngineTiers, TierPool, chunk_keys
from kvgate.sim.timing import TimingProfile

MODES = ("no_tiering", "lmcache", "kvgate")
MAX_BURST_MS = 50.0


@dataclass(frozen=True, slots=True)
class TierConfig:
    chunk_tokens: int = 256
    cpu_tokens_per_node: int = 1_500_000
    """LMCache L1 per node (1.5M tokens x 128 KiB = 196 GB of host memory)."""
    remote_tokens: int | None = None
    """LMCache L2 (Redis); None: large enough to keep everything of the run."""
    kv_bytes_per_token: int = 131_072
    cpu_gbps: float = 20.0
    remote_gbps: float = 2.5
    remote_rtt_ms: float = 1.0


@dataclass(slots=True)
class TurnResult:
    session: str
    round: int
    kind: str
    """``first`` (a session's first request), ``tool`` (resumed after a tool wait), ``user`` (a new user turn)."""
    heavy: bool
    worker: int
    arrival: float
    prompt: int
    novel: int
    """Prompt tokens the session never had computed before (beyond the previous chain)."""
    expected: int
    reuse: int = -1
    """Tokens not computed: GPU hit plus tier load (vLLM's cached_tokens)."""
    external: int = 0
    first_token: float | None = None
    finish: float | None = None
    gpu_resident: int = 0
    """Prefix tokens on the home worker's GPU when the request arrived (what its KV kept while waiting)."""

    @property
    def ttft_ms(self) -> float:
        assert self.first_token is not None
        return (self.first_token - self.arrival) * 1000

    @property
    def recomputed(self) -> int:
        return max(0, self.prompt - max(0, self.reuse) - self.novel)


@dataclass(slots=True)
class _Session:
    script: SessionScript
    next_round: int = 0
    chain: list[int] = field(default_factory=list)
    chain_hashes: list[BlockHash] = field(default_factory=list)
    home: int | None = None
    life: Lifecycle = field(default_factory=Lifecycle)
    reserved: tuple[int, int] | None = None
    """(worker, tokens) counted as reserved while a short tool wait lasts."""
    answer_size: int = 0
    """Tokens of the canonical prefix after the last answer (the size its continuation is counted under)."""
    prefill: _Prefill | None = None


@dataclass(slots=True)
class _Prefill:
    req: SimRequest
    worker: int
    divergence: int
    """Tokens of the prefilled prefix the old chain already had: reuse beyond this is the prefill's."""
    gain_ms: float
    orphan: bool = False
    """The conversation ended: the prefill is wasted."""


@dataclass(frozen=True, slots=True)
class _Step:
    worker: int
    plan: StepPlan | None
    """None: a decode burst."""


@dataclass(frozen=True, slots=True)
class _Settle:
    session: _Session
    next_round: int


@dataclass(frozen=True, slots=True)
class _Timer:
    session: _Session
    plan: WaitPlan


class AgentFleet:
    def __init__(self, profile: TimingProfile, n_workers: int, workers_per_node: int, mode: str, *,
                 prefill: bool = False, tiers: TierConfig | None = None, waits: WaitParams | None = None,
                 prefill_params: PrefillParams | None = None, continues: ContinueStats | None = None,
                 hash_seed: str = "0") -> None:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; expected one of {MODES}")
        self.profile = profile
        self.mode = mode
        self.tiercfg = tiers or TierConfig()
        tc = self.tiercfg
        self.hasher = VllmHasher(profile.block_size, "sha256", hash_seed)
        self.nodes = [f"node{i // workers_per_node}" for i in range(n_workers)]
        self.ids = [WorkerId(f"w{i}") for i in range(n_workers)]
        self.cpu = {n: TierPool(f"cpu:{n}", tc.cpu_tokens_per_node // tc.chunk_tokens) for n in set(self.nodes)}
        self.remote = TierPool("remote", None if tc.remote_tokens is None else tc.remote_tokens // tc.chunk_tokens)
        self.engines = [
            EngineCore(profile, self.hasher, tiers=None if mode == "no_tiering" else EngineTiers(
                self.cpu[self.nodes[i]], self.remote, tc.chunk_tokens, tc.kv_bytes_per_token, tc.cpu_gbps,
                tc.remote_gbps, tc.remote_rtt_ms))
            for i in range(n_workers)]
        self.index = PrefixIndex()
        self.max_model_len = (profile.num_blocks - 1) * profile.block_size
        params: CostParams = profile.cost_params(kv_bytes_per_token=tc.kv_bytes_per_token, cpu_load_gbps=tc.cpu_gbps,
                                                 remote_load_gbps=tc.remote_gbps, remote_rtt_ms=tc.remote_rtt_ms)
        self.policy = CostModel(params)
        self.predictor = WaitPredictor(waits)
        self.use_prefill = prefill
        self.prefill_params = prefill_params or PrefillParams()
        self.prefill_stats = PrefillStats.new()
        self.reserved = [0] * n_workers
        self.acct = [Accounting() for _ in range(n_workers)]
        self.reserved_samples: list[int] = []
        self.residency = TierResidency(chunk_tokens=tc.chunk_tokens)
        self.now = 0.0
        self.bg_computed = 0
        self.continues = continues or ContinueStats(self.prefill_params)
        """Per tenant (agent type) and size: answers followed by another user turn, or not."""

    # -- what kvgate knows -------------------------------------------------------------------------
    def _apply_events(self, w: int, events: list[KVEvent]) -> None:
        apply_events(self.index, self.ids[w], events)

    def _chunk_keys(self, hashes: list[BlockHash]) -> list[BlockHash]:
        return chunk_keys(hashes, self.profile.block_size, self.tiercfg.chunk_tokens)

    def _views(self) -> FleetView:
        cap = self.profile.num_blocks * self.profile.block_size
        return FleetView(tuple(
            self.acct[i].view(wid, kv_usage=self.engines[i].pool.usage(),
                              reserved_tokens=self.reserved[i] if self.mode == "kvgate" else 0,
                              kv_capacity_tokens=cap, node=self.nodes[i])
            for i, wid in enumerate(self.ids)))

    def _route(self, s: _Session, prompt: int, hashes: list[BlockHash], force: int | None) -> tuple[int, int]:
        if force is not None:
            return force, 0
        ints = [event_int(h) for h in hashes]
        matched = self.index.match(ints)
        cpu: dict[str, int] = {}
        remote = 0
        if self.mode == "kvgate":
            # Remote: checked (Redis EXISTS on the keys); CPU: kvgate's estimate, capped by the remote answer.
            remote = self.remote.leading(self._chunk_keys(hashes)) * self.tiercfg.chunk_tokens
            cpu = self.residency.cpu_tokens(s.script.id, remote, self.now)
        req = RouteRequest("m", ConversationId(s.script.id), self.ids[s.home] if s.home is not None else None,
                           prompt_tokens=prompt, matched_blocks=matched, block_size=self.profile.block_size,
                           cpu_tokens=cpu, remote_tokens=remote)
        d = self.policy.pick(req, self._views())
        assert d is not None
        return self.ids.index(d.worker), d.expected_cached_tokens

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

    # -- the loop ----------------------------------------------------------------------------------
    def run(self, scripts: list[SessionScript]) -> list[TurnResult]:
        sessions = {s.id: _Session(s) for s in scripts}
        heap: list[tuple[float, int, str, object]] = []
        seq = 0
        busy = [False] * len(self.engines)
        results: list[TurnResult] = []
        by_req: dict[str, tuple[_Session, TurnResult | None]] = {}
        mine: dict[str, int] = {}

        timers: list[float] = []  # times of the pending non-engine events, for the burst horizon

        def push(t: float, kind: str, payload: object) -> None:
            nonlocal seq
            seq += 1
            heapq.heappush(heap, (t, seq, kind, payload))
            if kind not in ("step", "burst"):
                heapq.heappush(timers, t)

        def kick(w: int, now: float) -> None:
            if not busy[w]:
                start(w, now)

        def start(w: int, now: float) -> None:
            core = self.engines[w]
            # Decode runs in bursts up to the next known arrival, at most MAX_BURST_MS: an arrival created
            # during a burst (a tool wait shorter than what is left of it) waits for the burst's end.
            horizon = min(MAX_BURST_MS, (timers[0] - now) * 1000.0 if timers else float("inf"))
            step = next_step(core, horizon)
            self._apply_events(w, core.take_events())
            busy[w] = step is not None
            if step is not None:
                ms, plan = step
                push(now + ms / 1000.0, "burst" if plan is None else "step", _Step(w, plan))

        def release(s: _Session) -> None:
            if s.reserved is not None:
                w, n = s.reserved
                self.reserved[w] -= n
                s.reserved = None

        def arrive(s: _Session, now: float) -> None:
            r = s.script.rounds[s.next_round]
            if self.mode == "kvgate" and s.life.state is State.AWAITING_TOOL and s.life.plan is not None:
                self.predictor.observe("t", s.life.tools, now - s.life.since, s.life.plan.predicted_s)
            release(s)
            if r.kind == "user" and s.next_round > 0:
                self.continues.continued(s.script.agent_type, s.answer_size)
            s.life = s.life.on(Event.REQUEST, now)
            tokens = canonical_history(s.script, s.next_round)
            if len(tokens) + len(r.reasoning) + len(r.visible) > self.max_model_len:
                # vLLM refuses to start with a max_model_len its KV cannot hold; a workload that needs more
                # is a configuration error, not a request to drop silently.
                raise ValueError(f"{s.script.id} needs {len(tokens) + len(r.reasoning) + len(r.visible)} tokens; "
                                 f"a worker holds {self.max_model_len}")
            hashes, common = self._hashes(s, tokens)
            force = None
            pf = s.prefill
            if pf is not None and pf.req.finish_time is None:
                # As the gateway does: the next request came first, so it goes where the prefill runs
                # and the prefill is aborted (the blocks it finished stay cached for this request).
                force = pf.worker
                self.engines[pf.worker].abort(pf.req.id)
                by_req.pop(pf.req.id, None)
                self.prefill_stats.skipped += 1
            gpu_home = 0
            if s.home is not None:
                held = self.index.match([event_int(h) for h in hashes]).get(self.ids[s.home], 0)
                gpu_home = held * self.profile.block_size
            w, expected = self._route(s, len(tokens), hashes, force)
            kind = "first" if s.next_round == 0 else r.kind
            res = TurnResult(s.script.id, s.next_round, kind, s.script.heavy, w, now,
                             len(tokens), len(tokens) - common, expected, gpu_resident=gpu_home)
            results.append(res)
            rid = f"{s.script.id}/{s.next_round}"
            sr = SimRequest(rid, tokens, r.reasoning + r.visible, arrival=now)
            sr.hashes = hashes
            by_req[rid] = (s, res)
            mine[rid] = max(1, len(tokens) - expected)
            self.acct[w].sent(mine[rid])
            s.home = w
            self.residency.stored(s.script.id, self.nodes[w], len(tokens), now)
            self.engines[w].add_request(sr)
            kick(w, now)

        def first_token(sr: SimRequest, w: int) -> None:
            s, res = by_req[sr.id]
            if res is None:
                return
            res.first_token = sr.first_token_time
            res.reuse = sr.num_cached_tokens
            res.external = sr.external_tokens
            self.acct[w].first_token(mine[sr.id], res.prompt)
            pf = s.prefill
            if pf is not None and res.round > 0:
                if res.reuse > pf.divergence:
                    self.prefill_stats.used += 1
                    self.prefill_stats.saved_ms += pf.gain_ms
                else:
                    self.prefill_stats.wasted += 1
                s.prefill = None

        def finished(sr: SimRequest, w: int, now: float) -> None:
            s, res = by_req.pop(sr.id)
            if res is None:  # a background prefill
                self.bg_computed += len(sr.prompt) - max(0, sr.num_cached_tokens)
                self.prefill_stats.completed += 1
                if s.prefill is not None and s.prefill.req is sr and s.prefill.orphan:
                    self.prefill_stats.wasted += 1
                    s.prefill = None
                kick(w, now)
                return
            res.finish = now
            self.acct[w].finished(res.prompt)
            r = s.script.rounds[res.round]
            s.chain = sr.prompt + sr.output
            s.chain_hashes = sr.hashes
            s.next_round += 1
            more = s.next_round < len(s.script.rounds)
            if r.tools:
                plan = self.predictor.plan("t", r.tools, now) if self.mode == "kvgate" else None
                s.life = s.life.on(Event.TOOL_CALLS, now, tools=r.tools, plan=plan)
                if plan is not None:
                    self._park(s, w, plan, now, push)
            else:
                s.life = s.life.on(Event.ANSWER, now)
                s.answer_size = len(next_turn_prefix(s.script, res.round))
                if self.use_prefill:  # the gateway cannot know whether the user will come back
                    self._maybe_prefill(s, res.round, w, by_req, now)
                    kick(w, now)
                # Whether the user comes back is learned as the gateway learns it: not at all for
                # settle_s after the answer means the conversation ended.
                push(now + self.prefill_params.settle_s, "settle", _Settle(s, s.next_round))
            if more:
                push(now + s.script.rounds[s.next_round].wait_s, "arrive", s)

        for s in sessions.values():
            push(s.script.start_s, "arrive", s)
        while heap:
            now, _, kind, payload = heapq.heappop(heap)
            self.now = now
            if kind not in ("step", "burst"):
                heapq.heappop(timers)
            if isinstance(payload, _Session):
                arrive(payload, now)
            elif isinstance(payload, _Timer):
                s = payload.session
                if s.life.plan is not payload.plan:
                    continue  # the wait it belonged to is over
                if kind == "lapse" and s.reserved is not None:
                    release(s)
                elif kind == "prefetch" and s.life.state is State.AWAITING_TOOL and s.home is not None:
                    self._prefetch(s)
            elif isinstance(payload, _Settle):
                s = payload.session
                if s.next_round == payload.next_round:  # nothing since the answer
                    self.continues.ended(s.script.agent_type, s.answer_size)
                    if s.prefill is not None:
                        if s.prefill.req.finish_time is None:
                            s.prefill.orphan = True  # settled when it ends
                        else:
                            self.prefill_stats.wasted += 1
                            s.prefill = None
            elif isinstance(payload, _Step):
                w = payload.worker
                if payload.plan is not None:
                    outs = self.engines[w].finish_step(payload.plan, now)
                    self._apply_events(w, self.engines[w].take_events())
                    for o in outs:
                        if o.request.generated == 1:
                            first_token(o.request, w)
                        if o.finished:
                            finished(o.request, w, now)
                start(w, now)
        stuck = [r for r in results if r.finish is None]
        if stuck or any(e.has_work() for e in self.engines if any(not q.background for q in e.waiting)):
            raise RuntimeError(f"{len(stuck)} requests never finished (a prompt larger than a worker's KV?)")
        return results

    # -- lifecycle ---------------------------------------------------------------------------------
    def _park(self, s: _Session, w: int, plan: WaitPlan, now: float,
              push: Callable[[float, str, object], None]) -> None:
        if plan.action == "reserve":
            n = len(s.chain)
            s.reserved = (w, n)
            self.reserved[w] += n
            self.reserved_samples.append(n)
            push(plan.deadline, "lapse", _Timer(s, plan))
        elif plan.prefetch_at is not None:
            push(plan.prefetch_at, "prefetch", _Timer(s, plan))

    def _prefetch(self, s: _Session) -> None:
        """LMCache prefetch: the session's chunks that only the remote tier holds, into the home node's
        CPU tier."""
        assert s.home is not None
        tiers = self.engines[s.home].tiers
        assert tiers is not None
        tiers.prefetch(self._chunk_keys(s.chain_hashes))
        self.residency.prefetched(s.script.id, self.nodes[s.home], len(s.chain) // self.tiercfg.chunk_tokens
                                  * self.tiercfg.chunk_tokens, self.now)

    def _maybe_prefill(self, s: _Session, last: int, w: int, by_req: dict[str, tuple[_Session, TurnResult | None]],
                       now: float) -> None:
        prefix = next_turn_prefix(s.script, last)
        bs = self.profile.block_size
        divergence = common_prefix(s.chain, prefix)
        gain = gain_tokens(divergence, len(prefix), bs)
        d = decide(self.prefill_params, gain, self.continues.p(s.script.agent_type, len(prefix)),
                   pending_requests=self.acct[w].pending_requests,
                   kv_usage=self.engines[w].pool.usage())
        self.prefill_stats.count(d)
        if not d.issue:
            return
        sr = SimRequest(f"{s.script.id}/bg{last}", prefix, [0], arrival=now, background=True)
        sr.hashes, _ = self._hashes(s, prefix, divergence)
        c = self.policy.params
        s.prefill = _Prefill(sr, w, divergence, c.p1_ms * gain + c.p_attn_ms * gain * divergence / 1e6)
        by_req[sr.id] = (s, None)
        self.engines[w].add_request(sr)

