"""Where a prepared request goes: the routing inputs gathered once per request (prefix match per worker,
tier residency), then a decision per attempt (the policy's, or the worker a background prefill of the
prompt's prefix still runs on)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from kvgate.clock import Clock
from kvgate.gateway.exchange import Prepared
from kvgate.gateway.lifecycle import ExchangeLifecycle, ExchangeObserver, Trust
from kvgate.gateway.observers import MetricsObserver, TraceObserver
from kvgate.gateway.prefix import PrefixKnowledge
from kvgate.gateway.prompts import Held
from kvgate.gateway.telemetry import GatewayMetrics
from kvgate.gateway.tierview import TierView
from kvgate.gateway.workers import WorkerPool
from kvgate.router.hashing import HashSpec
from kvgate.router.policies import Policy
from kvgate.router.residency import Residency
from kvgate.router.types import Decision, RouteRequest, WorkerId

DecisionListener = Callable[[Prepared, Decision, str, int], None]
"""Told of every decision made for a real request: (request, decision, front, attempt); ``front`` is
"proxy" or "epp". Listeners must not block (the gRPC WatchDecisions stream queues, bounded)."""


@dataclass(frozen=True, slots=True)
class Plan:
    """What routing reads of a request, computed once for all its attempts."""

    matched: Mapping[WorkerId, int]
    block_size: int
    cpu: Mapping[str, int]
    remote: int

    def matched_tokens(self, worker: WorkerId) -> int:
        return self.matched.get(worker, 0) * self.block_size

    @property
    def best_matched_tokens(self) -> int:
        return max(self.matched.values(), default=0) * self.block_size


class Router:
    def __init__(self, pool: WorkerPool, policy: Policy, prefix: PrefixKnowledge, tiers: TierView, clock: Clock,
                 metrics: GatewayMetrics, observers: Sequence[ExchangeObserver] | None = None) -> None:
        self.pool = pool
        self.policy = policy
        self.prefix = prefix
        self.tiers = tiers
        self.clock = clock
        self.metrics = metrics
        self.listeners: list[DecisionListener] = []
        self.observers: list[ExchangeObserver] = list(observers) if observers is not None else [
            MetricsObserver(metrics), TraceObserver()]
        """Told of every decision for a real request (the decision's metric, the ``route`` span)."""

    async def plan(self, p: Prepared) -> Plan:
        p.trace.routing(p)
        fleet = self.pool.snapshot(p.model)
        matched = self.prefix.match(p.model, p.prompt, fleet.workers, self.clock.now())
        bs = self.prefix.block_size(p.model)
        residency = p.conv.residency if p.conv is not None else Residency()
        cpu, remote = await self.tiers.tier_tokens(p.model, residency, p.prompt.tokens,
                                                   max(matched.values(), default=0) * bs, p.cache_salt)
        for w, host in self.prefix.host_tokens(p.prompt, fleet.workers).items():
            cpu[w] = max(cpu.get(w, 0), host)
        return Plan(matched, bs, cpu, remote)

    def holder(self, model: str) -> Held:
        """For the prompt builder: whether any worker of ``model`` with a hash identity holds a block."""
        def held(spec: HashSpec, block: int) -> bool:
            return any(self.prefix.holds(w.id, block) for w in self.pool.snapshot(model).workers
                       if self.pool.spec(w.id) == spec)

        return held

    def pick(self, p: Prepared, plan: Plan, tried: set[WorkerId], *, front: str = "proxy", attempt: int | None = None,
             observe: bool = True) -> Decision | None:
        """The worker for this attempt, none of ``tried``. ``observe=False``: a question (the control API's
        Explain), not counted in metrics nor told to listeners."""
        fleet = self.pool.snapshot(p.model)
        force = p.arrival.force
        forced = fleet.get(force) if force is not None and force not in tried else None
        if forced is not None and forced.healthy:
            # A background prefill of this prompt's prefix ran there: follow it.
            limit = max(0, (p.prompt.length - 1) // plan.block_size) * plan.block_size  # vLLM recomputes the last
            decision: Decision | None = Decision(forced.id, "prefill_pending", min(plan.matched_tokens(forced.id),
                                                                                    limit), tier="gpu")
        else:
            decision = self.policy.pick(self.route_request(p, plan, tried), fleet)
        if observe:
            for o in self.observers:
                o.routed(p, plan, decision, self.policy.name)
        if decision is not None and observe:
            for listener in self.listeners:
                listener(p, decision, front, attempt if attempt is not None else len(tried) + 1)
        return decision

    @staticmethod
    def route_request(p: Prepared, plan: Plan, tried: set[WorkerId]) -> RouteRequest:
        """What the policy reads of this request (the control API's Explain prices candidates with it)."""
        home = p.conv.home if p.conv is not None else p.parent_home
        return RouteRequest(model=p.model, conversation_id=p.ident.conversation_id, home_worker=home,
                            exclude=frozenset(tried), prompt_tokens=p.prompt.length, matched_blocks=plan.matched,
                            block_size=plan.block_size, cpu_tokens=plan.cpu, remote_tokens=plan.remote)

    def dispatched(self, p: Prepared, worker: WorkerId) -> None:
        """The request is on its way to ``worker``: its prompt counts there while it is in flight."""
        self.prefix.dispatched(p.model, worker, p.prompt, self.clock.now())

    def accepted(self, p: Prepared, worker: WorkerId) -> None:
        """The worker accepted the request: kvgate's view of its cache now includes this prompt."""
        self.prefix.routed(p.model, worker, p.prompt, self.clock.now())

    @staticmethod
    def lifecycle(p: Prepared, plan: Plan, trust: Trust = "own") -> ExchangeLifecycle:
        """The exchange of ``p`` with the workers ``plan`` prices, for a front to drive."""
        return ExchangeLifecycle(p, plan.block_size, {w: plan.matched_tokens(w) for w in plan.matched},
                                 plan.best_matched_tokens, trust)

    def node(self, worker: WorkerId) -> str:
        return self.pool.get(worker).config.node or worker
