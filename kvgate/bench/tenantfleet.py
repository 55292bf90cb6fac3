"""Tenants sharing a fleet in virtual time: kvgate's admission (the quota core, the slot pool, the learned
engine caps) and its router (the cost model) in front of simulated engines, driven by a discrete-event
loop, so a fairness policy is measured over many seeds and workloads in seconds and without the machine's
load in the numbers (``kvgate bench tenants``; the real-process run beside it checks the same on HTTP).

What the gateway is modelled with is production code: ``admission.quota.admit``/``release`` (a tenant's
concurrency leases), ``admission.slots.SlotPool`` (the fair queue and the share rule),
``admission.capacity.learn_slots`` (engine caps from polled counters, when not configured),
``router.cost.CostModel`` over ``sim.fleetcore.Accounting`` views (what the gateway knows of each worker,
plus its cap and its requests' holding time), a ``router.index.PrefixIndex`` fed by the engines' KV
events, and ``sim.engine.EngineCore`` for the engines. What is not: HTTP, tokenization, Redis (the quota
store's decisions are the memory store's; the Redis script is tested to agree).
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from dataclasses import dataclass

from kvgate.admission.capacity import SlotEstimate, learn_slots
from kvgate.admission.quota import Quota, TenantState, admit, release
from kvgate.admission.slots import SlotPool
from kvgate.router.cost import CostModel
from kvgate.router.index import PrefixIndex
from kvgate.router.types import ConversationId, FleetView, RouteRequest, WorkerId
from kvgate.sim.engine import EngineCore, SimRequest, StepPlan, make_core
from kvgate.sim.fleetcore import Accounting, apply_events, next_step
from kvgate.sim.timing import TimingProfile, get_profile

LIGHT, HEAVY = "light", "heavy"


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    workers: int = 3
    slots: int = 4
    """The engines' ``max_num_seqs``."""
    light_rps: float = 2.0
    heavy_factor: float = 10.0
    prompt: tuple[int, int] = (300, 300)
    """Prompt tokens, uniform in this range (a request's own text: no prefix shared with others)."""
    output: tuple[int, int] = (24, 24)
    light_turns: int = 1
    """> 1: the light tenant is an agent, each request the next turn of one of its conversations (its
    history plus a new ``prompt``), up to this many turns, so its prefixes are cached where it was served."""
    seconds: float = 40.0
    slowdown: float = 4.0
    profile: str = "h100-llama3-8b"

    def timing(self) -> TimingProfile:
        p = get_profile(self.profile)
        f = self.slowdown
        return p.with_overrides(max_num_seqs=self.slots, p0=p.p0 * f, p1=p.p1 * f, p2=p.p2 * f,
                                p_attn=p.p_attn * f, d_min=p.d_min * f, d0=p.d0 * f, d1=p.d1 * f, d2=p.d2 * f,
                                d_seq=p.d_seq * f, d_ctx=p.d_ctx * f)


@dataclass(frozen=True, slots=True)
class Mode:
    name: str
    heavy: bool = True
    admission: bool = True
    fair_share: bool = True
    slot_wait: bool = True
    """The cost model prices the wait for a running slot (off: ``slot_wait_weight`` 0)."""
    learned: bool = False
    """Engine caps learned from their counters (polled every ``POLL_S``) instead of configured."""
    max_concurrent: int | None = 8
    share_window_s: float = 10.0
    light_weight: float = 1.0
    queue_size: int = 64
    max_queue_wait_s: float = 5.0


POLL_S = 1.0


@dataclass(slots=True, eq=False)
class Req:
    id: str
    tenant: str
    arrival: float
    tokens: list[int]
    output: int
    conversation: str
    status: int = 0
    first: float | None = None
    finish: float | None = None
    worker: int = -1
    lease: str = ""
    queued: bool = False
    expected: int = 0
    dispatched: float = 0.0


@dataclass
class Outcome:
    """One run: every request with its status (200, 429, 503) and times."""

    requests: list[Req]

    def ttft_ms(self, tenant: str) -> list[float]:
        return [(r.first - r.arrival) * 1000 for r in self.requests
                if r.tenant == tenant and r.status == 200 and r.first is not None]

    def statuses(self, tenant: str) -> dict[int, int]:
        out: dict[int, int] = {}
        for r in self.requests:
            if r.tenant == tenant:
                out[r.status] = out.get(r.status, 0) + 1
        return out

    def completed_tokens(self, tenant: str) -> int:
        return sum(r.output for r in self.requests if r.tenant == tenant and r.finish is not None)


def arrivals(w: Workload, seed: int, heavy: bool) -> list[Req]:
    """The light tenant's requests, and the heavy one's at ``heavy_factor`` times its rate (Poisson, open loop)."""
    out: list[Req] = []
    counter = itertools.count(1)
    for tenant, rps, s in ((LIGHT, w.light_rps, seed), (HEAVY, w.light_rps * w.heavy_factor, seed + 1000)):
        if tenant == HEAVY and not heavy:
            continue
        rng = random.Random(s)
        history: dict[int, list[int]] = {}
        turns: dict[int, int] = {}
        t, n = 0.0, 0
        while True:
            t += rng.expovariate(rps)
            if t >= w.seconds:
                break
            new = [next(counter) for _ in range(rng.randint(*w.prompt))]
            out_len = rng.randint(*w.output)
            conv = n
            if tenant == LIGHT and w.light_turns > 1:
                conv = rng.randrange(max(1, int(w.light_rps * w.seconds / w.light_turns)))
                if turns.get(conv, 0) >= w.light_turns:
                    history.pop(conv, None)
                    turns[conv] = 0
                new = history.get(conv, []) + new
                # The next turn's history: this prompt and its answer (stand-in tokens of its own).
                history[conv] = new + [next(counter) for _ in range(out_len)]
                turns[conv] = turns.get(conv, 0) + 1
            out.append(Req(f"{tenant}-{n}", tenant, t, new, out_len, f"{tenant}/{conv}"))
            n += 1
    return sorted(out, key=lambda r: (r.arrival, r.id))


class TenantFleet:
    """One run of a workload under one mode."""

    def __init__(self, w: Workload, mode: Mode) -> None:
        self.w, self.mode = w, mode
        self.profile = w.timing()
        self.engines: list[EngineCore] = [make_core("vllm", self.profile) for _ in range(w.workers)]
        self.ids = [WorkerId(f"w{i}") for i in range(w.workers)]
        self.acct = [Accounting() for _ in range(w.workers)]
        self.caps = [SlotEstimate(None if mode.learned else w.slots) for _ in range(w.workers)]
        self.service_ms = [0.0] * w.workers
        self.router = CostModel(self.profile.cost_params(slot_wait_weight=1.0 if mode.slot_wait else 0.0))
        self.index = PrefixIndex()
        self.home: dict[str, WorkerId] = {}
        self.pool: SlotPool[Req] = SlotPool(mode.queue_size, mode.share_window_s if mode.fair_share else None)
        self.quota: dict[str, TenantState] = {}
        self._heap: list[tuple[float, int, str, object]] = []
        self._seq = itertools.count()
        self._busy = [False] * w.workers
        self._by_id: dict[str, Req] = {}
        self._leases = itertools.count()

    # -- events --------------------------------------------------------------------------------------
    def _at(self, t: float, kind: str, data: object) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), kind, data))

    def run(self, reqs: list[Req]) -> Outcome:
        for r in reqs:
            self._at(r.arrival, "arrive", r)
            self._by_id[r.id] = r
        if self.mode.learned:
            self._at(POLL_S, "poll", None)
        while self._heap:
            now = self._heap[0][0]
            touched: set[int] = set()
            while self._heap and self._heap[0][0] <= now:
                _, _, kind, data = heapq.heappop(self._heap)
                touched |= self._event(kind, data, now)
            horizon = (self._heap[0][0] - now) * 1000 if self._heap else math.inf
            for i in sorted(touched):
                if not self._busy[i]:
                    step = next_step(self.engines[i], horizon)
                    apply_events(self.index, self.ids[i], self.engines[i].take_events())
                    if step is not None:
                        self._busy[i] = True
                        self._at(now + step[0] / 1000, "step", (i, step[1]))
        return Outcome(reqs)

    def _pending(self) -> bool:
        return any(k != "poll" for _, _, k, _ in self._heap) or any(self._busy)

    def _event(self, kind: str, data: object, now: float) -> set[int]:
        if kind == "arrive":
            assert isinstance(data, Req)
            return self._arrive(data, now)
        if kind == "step":
            assert isinstance(data, tuple)
            return self._step(data[0], data[1], now)
        if kind == "timeout":
            assert isinstance(data, Req)
            if data.queued and self.pool.remove(data.tenant, data, now):
                data.queued, data.status = False, 503
                self._drop_lease(data)
            return set()
        self._poll(now)
        return set()

    # -- the gateway -----------------------------------------------------------------------------------
    def _capacity(self) -> int | None:
        caps = [c.cap for c in self.caps]
        return None if any(c is None for c in caps) else sum(c for c in caps if c is not None)

    def _arrive(self, r: Req, now: float) -> set[int]:
        m = self.mode
        if not m.admission:
            r.status = 200
            return {self._dispatch(r, now)}
        cap = self._capacity()
        if cap is not None and self.pool.busy >= cap and self.pool.full:
            r.status = 503
            return set()
        r.lease = f"l{next(self._leases)}"
        state, verdict = admit(self.quota.get(r.tenant, TenantState()), Quota(m.max_concurrent), now,
                               len(r.tokens), r.lease, 1e9)
        self.quota[r.tenant] = state
        if not verdict.ok:
            r.status = 429
            return set()
        r.status = 200
        self.pool.arrive(r.tenant, m.light_weight if r.tenant == LIGHT else 1.0, now)
        if self.pool.try_take(r.tenant, "interactive", cap, now):
            return {self._dispatch(r, now)}
        if not self.pool.push(r.tenant, "interactive", r):
            r.status = 503
            self._drop_lease(r)
            return set()
        r.queued = True
        self._at(now + m.max_queue_wait_s, "timeout", r)
        return self._grant(now)

    def _grant(self, now: float) -> set[int]:
        out = set()
        for q in self.pool.grant(self._capacity(), now):
            q.queued = False
            out.add(self._dispatch(q, now))
        return out

    def _drop_lease(self, r: Req) -> None:
        self.quota[r.tenant] = release(self.quota[r.tenant], r.lease)

    def _dispatch(self, r: Req, now: float) -> int:
        core = self.engines[0]
        hashes = [core.kind.event_int(h) for h in core.hasher.block_hashes(r.tokens)]
        matched = self.index.match(hashes)
        views = tuple(a.view(wid, max_running=self.caps[i].cap or 0, service_ms=self.service_ms[i])
                      for i, (wid, a) in enumerate(zip(self.ids, self.acct, strict=True)))
        req = RouteRequest("m", ConversationId(r.conversation), self.home.get(r.conversation),
                           prompt_tokens=len(r.tokens), matched_blocks=matched, block_size=self.profile.block_size)
        d = self.router.pick(req, FleetView(views))
        assert d is not None
        i = self.ids.index(d.worker)
        self.home[r.conversation] = d.worker
        r.worker, r.expected = i, d.expected_cached_tokens
        self.engines[i].add_request(SimRequest(r.id, r.tokens, [0] * r.output, arrival=now))
        self.acct[i].acquire(max(1, len(r.tokens) - d.expected_cached_tokens))
        r.dispatched = now
        return i

    def _step(self, i: int, plan: StepPlan | None, now: float) -> set[int]:
        self._busy[i] = False
        touched = {i}
        if plan is None:
            return touched
        core = self.engines[i]
        for o in core.finish_step(plan, now):
            r = self._by_id[o.request.id]
            if r.first is None:
                r.first = now
                self.acct[i].first_token(max(1, len(r.tokens) - r.expected), len(r.tokens))
            if o.finished:
                r.finish = now
                self.acct[i].release(context_tokens=len(r.tokens), got_first_token=True)
                held = (now - r.dispatched) * 1000
                s = self.service_ms[i]
                self.service_ms[i] = held if s == 0 else s + 0.1 * (held - s)
                if self.mode.admission:
                    self.pool.release(r.tenant, now)
                    self._drop_lease(r)
                    touched |= self._grant(now)
        apply_events(self.index, self.ids[i], core.take_events())
        return touched

    def _poll(self, now: float) -> None:
        for i, core in enumerate(self.engines):
            running, waiting = core.step_stats()
            self.caps[i] = learn_slots(self.caps[i], running, waiting, now)
        if self._pending():
            self._at(now + POLL_S, "poll", None)


def run(w: Workload, mode: Mode, seed: int) -> Outcome:
    return TenantFleet(w, mode).run(arrivals(w, seed, mode.heavy))

