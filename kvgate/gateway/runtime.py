"""The session controller at run time: its commands executed with asyncio, httpx and the shared stores.

- A request's arrival and completion go through the controller in the request path (``record.py``);
  their commands come here.
- Timers live in the fleet store (``kvstore/fleet.py``): every replica ticks, claims the timers that are
  due (each is claimed by one replica, under a lease), runs the controller's ``fired`` step on the
  conversation's record and executes what it returns. A replica that dies mid-timer loses its lease and
  another one runs the timer.
- Learned statistics: every replica applies the fleet's observations, in the same order, at each tick.
- Tenant budgets (``admission/budgets.py``, with admission on): a reservation is written only within
  its tenant's parked-KV budget (a refusal is committed back through the controller, so the record never
  claims KV the store does not hold); a prefill is decided on the tenant's prefill tokens left and
  charged to them when issued.

Everything here is advisory: a command that fails is logged and counted, and no request waits on it.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections import defaultdict
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import replace
from typing import Any, Protocol

from kvgate.admission.budgets import TenantBudgets
from kvgate.gateway import tracing
from kvgate.gateway.telemetry import GatewayMetrics
from kvgate.gateway.tracing import Tracing
from kvgate.kvstore.conversations import ConversationStore, StoreError
from kvgate.kvstore.corrupt import CorruptCollector
from kvgate.kvstore.fleet import FleetStore, Timer
from kvgate.router.cost import CostParams
from kvgate.router.types import ConversationId, WorkerId
from kvgate.session.controller import (
    ArmTimer,
    CancelPrefill,
    CancelTimers,
    Command,
    ComputePrefix,
    Count,
    IssuePrefill,
    Observe,
    Prefetch,
    Reserve,
    SessionController,
    Step,
    Unreserve,
)
from kvgate.session.conversation import Conversation
from kvgate.session.state import Learned, SessionState
from kvgate.tasks import cancel_and_wait, stopping

log = logging.getLogger(__name__)

Transition = Callable[[SessionState, Conversation], Step]

_METRICS = {"prefills": "prefills", "prefill_decisions": "prefill_decisions", "tool_waits": "tool_waits",
            "wait_plans": "wait_plans", "retentions": "retentions"}


class Actions(Protocol):
    """The I/O the controller's commands need (``gateway/actions.py``)."""

    def reserve_locally(self, worker: WorkerId, tokens: int) -> None: ...

    def set_reserved(self, totals: dict[WorkerId, int]) -> None: ...

    async def prefetch(self, conv: Conversation, worker: WorkerId) -> bool: ...

    async def pin(self, conv: Conversation, *, unpin: bool = False) -> bool:
        """Pin (unpin) the conversation's chain in the L2 tier (False: no tier to pin in, or it failed)."""
        ...

    async def next_prefix(self, conv: Conversation) -> tuple[int, list[int]] | None:
        """(divergence from the cached chain, the next turn's prefix tokens), None without a tokenizer."""
        ...

    def worker_load(self, worker: WorkerId) -> tuple[int, float]:
        """(requests waiting for their first token, KV usage 0..1)."""
        ...

    def block_size(self, worker: WorkerId) -> int: ...

    def cost(self) -> CostParams: ...

    async def send_prefill(self, model: str, worker: WorkerId, tokens: list[int], tenant: str = "") -> bool: ...


class SessionRuntime:
    def __init__(self, controller: SessionController, learned: Learned, store: ConversationStore,
                 fleet: FleetStore, actions: Actions, metrics: GatewayMetrics, wall: Callable[[], float], *,
                 tick_s: float = 0.1, lease_s: float = 60.0, tracing: Tracing | None = None,
                 budgets: TenantBudgets | None = None) -> None:
        self.controller = controller
        self.learned = learned
        self.store = store
        self.fleet = fleet
        self.actions = actions
        self.metrics = metrics
        self.wall = wall
        self.tick_s = tick_s
        self.lease_s = lease_s
        """How long a claimed timer stays this replica's: a background prefill runs within it."""
        self.counters: dict[tuple[str, str], float] = defaultdict(float)
        self.tracing = tracing or Tracing()
        """Background prefills and prefetches are traces of their own, linked to the conversation's last turn."""
        self.budgets = budgets
        """None: admission off, no tenant budgets."""
        self._prefills: dict[tuple[ConversationId, int], asyncio.Task[None]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._loop: asyncio.Task[None] | None = None
        self.ticks = 0
        metrics.registry.register(CorruptCollector((store.corruption, fleet.corruption)))

    # -- commands ----------------------------------------------------------------------------------
    def spawn(self, aw: Awaitable[Any], name: str) -> asyncio.Task[Any]:
        async def run() -> Any:
            try:
                return await aw
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # advisory work: never let it escape
                log.warning("%s failed: %r", name, exc)
                return None

        task = asyncio.get_running_loop().create_task(run(), name=name)
        self._tasks.add(task)  # a task nobody references may be collected before it runs
        task.add_done_callback(self._tasks.discard)
        if inspect.iscoroutine(aw):
            task.add_done_callback(lambda _: _close_unstarted(aw))
        return task

    async def execute(self, cid: ConversationId, conv: Conversation | None, commands: Sequence[Command]) -> None:
        for cmd in commands:
            try:
                await self._one(cid, conv, cmd)
            except StoreError as exc:
                self.metrics.session_store_errors.inc()
                log.warning("%s of %s: %s", type(cmd).__name__, cid, exc)

    async def _one(self, cid: ConversationId, conv: Conversation | None, cmd: Command) -> None:
        if isinstance(cmd, Count):
            self._count(cmd)
        elif isinstance(cmd, Observe):
            await self.fleet.publish(cmd.observation)
        elif isinstance(cmd, ArmTimer):
            await self.fleet.arm(cid, cmd.kind, cmd.due, cmd.token)
        elif isinstance(cmd, CancelTimers):
            await self.fleet.cancel(cid, cmd.kinds)
        elif isinstance(cmd, Reserve):
            await self._reserve(cid, conv, cmd)
        elif isinstance(cmd, Unreserve):
            await self.fleet.unreserve(cmd.worker, cid, tenant=conv.tenant if conv is not None else "")
            self.actions.reserve_locally(cmd.worker, -cmd.tokens)
            if conv is not None:  # the chain is the one pinned with the reservation: the record's, until
                # the next request completes
                self.spawn(self.actions.pin(conv, unpin=True), f"unpin:{cid}")
        elif isinstance(cmd, CancelPrefill):
            task = self._prefills.pop((cid, cmd.token), None)
            if task is not None:
                task.cancel()  # vLLM aborts a request whose connection closes
        elif isinstance(cmd, Prefetch) and conv is not None:
            await self._prefetch(cid, conv, cmd)
        elif isinstance(cmd, ComputePrefix) and conv is not None:
            await self._compute_prefix(cid, conv, cmd)

    async def _reserve(self, cid: ConversationId, conv: Conversation | None, cmd: Reserve) -> None:
        tenant = conv.tenant if conv is not None else ""
        budget = self.budgets.parked_limit(tenant) if self.budgets is not None else None
        if await self.fleet.reserve(cmd.worker, cid, cmd.tokens, cmd.until, tenant=tenant, now=self.wall(),
                                    budget=budget):
            self.actions.reserve_locally(cmd.worker, cmd.tokens)
            if conv is not None:  # granted within the tenant's parked-KV budget: so is the L2 pin beside it
                self.spawn(self.actions.pin(conv), f"pin:{cid}")
            return
        # Another replica took the tenant's remaining room since the controller planned: the record drops
        # the reservation (no Unreserve follows: neither the store nor the worker view holds it).
        done = await self.commit(cid, lambda s, _c: self.controller.reservation_refused(
            s, token=cmd.token, learned=self.learned))
        if done is not None:
            await self.execute(cid, done[0], done[1].commands)

    def _count(self, c: Count) -> None:
        self.counters[(c.name, c.label)] += c.amount
        name = _METRICS.get(c.name)
        if name is not None:
            getattr(self.metrics, name).labels(c.label).inc(c.amount)

    # -- commit --------------------------------------------------------------------------------------
    async def commit(self, cid: ConversationId, transition: Transition) -> tuple[Conversation, Step] | None:
        """Apply a controller step to the conversation's current record (re-applied if another writer got
        there first); None when there is no record."""
        box: list[Step] = []

        def fn(cur: Conversation | None) -> Conversation | None:
            if cur is None:
                return None
            step = transition(cur.session, cur)
            box[:] = [step]
            return None if step.state == cur.session else replace(cur, session=step.state)

        conv = await self.store.update(cid, fn)
        return (conv, box[0]) if conv is not None and box else None

    @tracing.background("prefetch")
    async def _prefetch(self, cid: ConversationId, conv: Conversation, cmd: Prefetch) -> None:
        tracing.note(**{"kvgate.prefetch.asked": await self.actions.prefetch(conv, cmd.worker)})

    # -- background prefill ------------------------------------------------------------------------
    @tracing.background("prefill")
    async def _compute_prefix(self, cid: ConversationId, conv: Conversation, cmd: ComputePrefix) -> None:
        got = await self.actions.next_prefix(conv)
        if got is None:
            self._count(Count("prefill_decisions", "no_tokens"))
            return
        divergence, prefix = got
        pending, kv = self.actions.worker_load(cmd.worker)
        left = await self.budgets.prefill_left(conv.tenant) if self.budgets is not None else None
        done = await self.commit(cid, lambda s, _c: self.controller.prefix_ready(
            s, token=cmd.token, worker=cmd.worker, divergence=divergence, prefix_tokens=len(prefix),
            block_size=self.actions.block_size(cmd.worker), pending_requests=pending, kv_usage=kv,
            cost=self.actions.cost(), learned=self.learned, prefill_budget=left))
        if done is None:
            return
        conv, step = done
        tracing.note(**{"kvgate.prefill.decision": next((c.label for c in step.commands if isinstance(c, Count)
                                                         and c.name == "prefill_decisions"), None)})
        await self.execute(cid, conv, [c for c in step.commands if not isinstance(c, IssuePrefill)])
        for c in step.commands:
            if isinstance(c, IssuePrefill):
                if self.budgets is not None:
                    await self.budgets.charge_prefill(conv.tenant, c.gain_tokens)
                task = self.spawn(self._prefill(cid, conv.model, c, prefix, conv.tenant), f"prefill:{cid}")
                self._prefills[(cid, c.token)] = task
                await asyncio.wait({task})  # the timer's lease covers the prefill

    @tracing.client("prefill request")
    async def _prefill(self, cid: ConversationId, model: str, cmd: IssuePrefill, prefix: list[int],
                       tenant: str = "") -> None:
        try:
            ok = await self.actions.send_prefill(model, cmd.worker, prefix, tenant)
        finally:
            self._prefills.pop((cid, cmd.token), None)
        done = await self.commit(cid, lambda s, _c: self.controller.prefill_done(s, token=cmd.token, ok=ok))
        if done is not None:
            await self.execute(cid, done[0], done[1].commands)
        else:
            self._count(Count("prefills", "completed" if ok else "failed"))

    # -- timers and learned statistics -------------------------------------------------------------
    async def tick(self) -> None:
        """One round of the loop: apply new observations, refresh reservations, run due timers."""
        self.ticks += 1
        for obs in await self.fleet.observations():
            self.learned.apply(obs)
        now = self.wall()
        self.actions.set_reserved(await self.fleet.reserved(now))
        for t in await self.fleet.claim(now, self.lease_s):
            self.spawn(self._fire(t), f"timer:{t.kind}:{t.conversation}")

    async def _fire(self, t: Timer) -> None:
        work = self.spawn(self._run_timer(t), f"timer-work:{t.kind}:{t.conversation}")
        try:
            # Hold the lease while the work runs (a background prefill takes seconds): renewed at a third
            # of its length, so it lapses only if this replica stops.
            while not work.done():
                await asyncio.wait({work}, timeout=self.lease_s / 3)
                if not work.done():
                    await self.fleet.renew(t, self.wall() + self.lease_s)
        finally:
            await self.fleet.done(t)

    async def _run_timer(self, t: Timer) -> None:
        done = await self.commit(t.conversation, lambda s, c: self.controller.fired(
            s, kind=t.kind, token=t.token, home=c.home))
        if done is not None:
            await self.execute(t.conversation, done[0], done[1].commands)

    async def _run(self) -> None:
        last_error = ""
        while not stopping():
            try:
                await self.tick()
            except StoreError as exc:
                self.metrics.session_store_errors.inc()
                log.warning("session runtime tick: %s", exc)
            except Exception as exc:
                # The loop is every replica's timers and reservations: whatever one tick met (a value in
                # the shared store no version wrote), the next tick runs. Logged when it changes, not
                # ten times a second.
                self.metrics.session_store_errors.inc()
                if repr(exc) != last_error:
                    log.exception("session runtime tick failed")
                last_error = repr(exc)
            else:
                last_error = ""
            await asyncio.sleep(self.tick_s)

    def start(self) -> None:
        if self._loop is None:
            self._loop = asyncio.get_running_loop().create_task(self._run(), name="session-runtime")

    async def aclose(self) -> None:
        tasks = [t for t in (self._loop, *self._tasks) if t is not None]
        for t in tasks:
            t.cancel()
        for t in tasks:
            await cancel_and_wait(t)
        self._loop = None

    def snapshot(self) -> dict[str, Any]:
        c = self.counters
        prefill = {k: int(c[("prefills", k)]) for k in ("issued", "completed", "failed", "used", "wasted", "skipped")}
        return {"waits": self.learned.waits.snapshot(), "continuation": self.learned.continues.snapshot(),
                "prefill": {**prefill, "saved_ms": round(c[("prefill_saved_ms", "")], 1),
                            "decisions": {lab: int(n) for (name, lab), n in c.items() if name == "prefill_decisions"}}}


def _close_unstarted(coro: Coroutine[Any, Any, Any]) -> None:
    # A task cancelled before it ran (shutdown) never awaited the work's coroutine: close it quietly.
    if inspect.getcoroutinestate(coro) == inspect.CORO_CREATED:
        coro.close()
