"""The session controller: what happens to a conversation's KV between and around its requests.

Pure (events in, commands out, no I/O, time as an argument): the gateway executes the commands with
asyncio, httpx and Redis (``gateway/runtime.py``); the tiering benchmark executes the very same steps
on simulated engines in virtual time (``sim/sessions.py``). Each step takes the conversation's
``SessionState`` and returns the next one with the commands to run; the lifecycle inside it stays the
one explicit state machine (``session/lifecycle.py``).

Events and what they do:

- **arrived** (a request of the conversation): the lifecycle moves to ``generating``; the KV parked
  for a tool wait is released and the conversation's timers are cancelled; a background prefill that
  still runs is cancelled and the request is forced onto its worker (the blocks it finished stay
  cached there). The tool wait that just ended, and whether the user came back after an answer, are
  remembered and fed back only when the request completes (a failed request teaches nothing, and a
  retried one teaches once).
- **ended** (the response ended, with tool calls or an answer): a prefill that ran for this request is
  settled (used when the cached tokens reach past its divergence point); on tool calls, the wait is
  predicted and planned — reserve the KV on the home worker (with a lapse timer) or release it and
  prefetch it from the remote tier shortly before the predicted resume; a reservation the tenant's
  parked-KV budget cannot hold is planned as a release (``over_budget``); on an answer, a settle timer
  and (when enabled) a prefill timer are armed, and a request that asked for its KV to be kept
  (``retain_s``: Anthropic's ``cache_control``, OpenAI's ``prompt_cache_retention``; ``session/retention.py``)
  has it reserved on the home worker for that long (capped), within the same parked-KV budget.
- **reservation_refused**: the fleet store refused a planned reservation (another replica took the
  tenant's remaining budget first): the conversation drops it and takes the release path after all.
- **fired** (a timer): ``lapse`` releases a reservation; ``prefetch`` asks for a prefetch;
  ``settle`` counts the conversation as ended (and a prefill nobody used as wasted); ``prefill``
  asks the executor for the next turn's prefix.
- **prefix_ready** (the executor rendered the next-turn prefix): the prefill rule
  (``session/prefill.py``) decides, within the tenant's background-prefill budget, and a prefill is
  issued or not.
- **prefill_done**: the prefill request finished (or failed).

The tenant budgets (``admission/budgets.py``) come in as numbers (what is left now; None: unlimited),
so the controller stays pure and the benchmarks run it without them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from kvgate.router.cost import CostParams
from kvgate.router.types import WorkerId
from kvgate.session.lifecycle import Event, State
from kvgate.session.prefill import PrefillParams, decide, gain_tokens
from kvgate.session.state import (
    LAPSE,
    PREFETCH,
    PREFILL,
    SETTLE,
    Answer,
    ContinuationObserved,
    Learned,
    Observation,
    PendingPrefill,
    Reservation,
    SessionState,
    WaitObserved,
    WaitSample,
)


# -- commands ------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Reserve:
    worker: WorkerId
    tokens: int
    until: float
    token: int
    """The reservation's token (``reservation_refused`` names it)."""


@dataclass(frozen=True, slots=True)
class Unreserve:
    worker: WorkerId
    tokens: int


@dataclass(frozen=True, slots=True)
class ArmTimer:
    kind: str
    due: float
    token: int


@dataclass(frozen=True, slots=True)
class CancelTimers:
    kinds: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Prefetch:
    worker: WorkerId


@dataclass(frozen=True, slots=True)
class ComputePrefix:
    """Render the next turn's canonical prefix and answer with ``prefix_ready`` (same token)."""

    worker: WorkerId
    token: int


@dataclass(frozen=True, slots=True)
class IssuePrefill:
    worker: WorkerId
    token: int
    gain_tokens: int
    """What the prefill computes (the prefix beyond the cached chain): charged to the tenant's budget."""


@dataclass(frozen=True, slots=True)
class CancelPrefill:
    worker: WorkerId
    token: int


@dataclass(frozen=True, slots=True)
class Observe:
    observation: Observation


@dataclass(frozen=True, slots=True)
class Count:
    """A counter for operators and benchmarks: ``prefills{outcome}``, ``prefill_decisions{reason}``,
    ``prefill_saved_ms``, ``tool_waits{outcome}``, ``wait_plans{action}`` (``reserve``, ``release``,
    ``over_budget``), ``retentions{outcome}`` (``reserve``, ``over_budget``, ``lapsed``, ``refused``)."""

    name: str
    label: str = ""
    amount: float = 1.0


Command = (Reserve | Unreserve | ArmTimer | CancelTimers | Prefetch | ComputePrefix | IssuePrefill | CancelPrefill
           | Observe | Count)


@dataclass(frozen=True, slots=True)
class Step:
    state: SessionState
    commands: tuple[Command, ...] = ()
    force: WorkerId | None = None
    """arrived only: the worker the request must go to (a prefill of its prefix runs there)."""


@dataclass(frozen=True, slots=True)
class ControllerParams:
    prefill: PrefillParams = field(default_factory=lambda: PrefillParams(enabled=False))
    plan_waits: bool = True
    """Predict tool waits and reserve or prefetch their KV (off: the lifecycle alone, as a fleet
    without tiers runs)."""
    max_retain_s: float = 3600.0
    """The longest a request may ask an answer's KV to be kept (``retain_s``); 0: such asks are ignored."""


class SessionController:
    def __init__(self, params: ControllerParams | None = None) -> None:
        self.params = params or ControllerParams()

    # -- a request arrives -------------------------------------------------------------------------
    def arrived(self, s: SessionState, *, tenant: str, now: float, user_turn: bool) -> Step:
        cmds: list[Command] = []
        life = s.lifecycle
        waited = now - life.since
        wait = None
        if life.state is State.AWAITING_TOOL and life.plan is not None and waited >= 0:
            wait = WaitSample(tenant, life.tools, waited, life.plan.predicted_s)
        if s.reservation is not None:
            cmds.append(Unreserve(s.reservation.worker, s.reservation.tokens))
        if s.timers:
            cmds.append(CancelTimers(tuple(k for k, _ in s.timers)))
        force = None
        prefill = s.prefill
        if prefill is not None and prefill.running:
            cmds += [CancelPrefill(prefill.worker, prefill.token), Count("prefills", "skipped")]
            force = prefill.worker
            prefill = replace(prefill, running=False)
        cont = s.answer if user_turn and life.state is State.AWAITING_USER else None
        new = replace(s, lifecycle=life.on(Event.REQUEST, now), reservation=None, timers=(), prefill=prefill,
                      answer=None, pending_wait=wait, pending_continue=cont)
        return Step(new, tuple(cmds), force)

    # -- its response ended ------------------------------------------------------------------------
    def ended(self, s: SessionState, *, tenant: str, worker: WorkerId, now: float, tools: tuple[str, ...],
              kv_tokens: int, cached_tokens: int | None, learned: Learned, parked_budget: int | None = None,
              retain_s: float | None = None) -> Step:
        """``kv_tokens``: the context the worker now holds (prompt + completion); ``cached_tokens``: what
        the request reused (None when the worker reported no usage); ``parked_budget``: KV tokens the
        tenant may still park (its budget minus what its conversations hold reserved now; None: no
        budget); ``retain_s``: how long the request asked for its KV to be kept (None: not asked), honoured
        on an answer; on tool calls the wait's own plan stands."""
        cmds = self._settle_prefill(s.prefill, cached_tokens) + self._feedback(s)
        s = replace(s, prefill=None, pending_wait=None, pending_continue=None)
        if tools:
            return self._tool_wait(s, tenant, worker, now, tools, kv_tokens, learned, cmds, parked_budget)
        s = replace(s, lifecycle=s.lifecycle.on(Event.ANSWER, now), answer=Answer(tenant, kv_tokens, now))
        s, arm = self._arm(s, SETTLE, now + self.params.prefill.settle_s)
        cmds.append(arm)
        if self.params.prefill.enabled:
            s, arm = self._arm(s, PREFILL, now)
            cmds.append(arm)
        return self._retain(s, worker, now, kv_tokens, retain_s, parked_budget, cmds)

    def _retain(self, s: SessionState, worker: WorkerId, now: float, kv_tokens: int, retain_s: float | None,
                parked_budget: int | None, cmds: list[Command]) -> Step:
        """An answer whose request asked for its KV to be kept: reserved as a short tool wait is, since
        the client said the prefix is worth it, until it lapses or the next request releases it."""
        cap = self.params.max_retain_s
        if not retain_s or retain_s <= 0 or cap <= 0:
            return Step(s, tuple(cmds))
        if s.reservation is not None or s.lifecycle.state is not State.AWAITING_USER:
            # Another branch is in flight or holds a tool wait's reservation: the record keeps one
            # reservation, and that one's lapse timer must still find it.
            return Step(s, tuple(cmds))
        if parked_budget is not None and kv_tokens > parked_budget:
            return Step(s, (*cmds, Count("retentions", "over_budget")))
        until = now + min(retain_s, cap)
        s, arm = self._arm(s, LAPSE, until)
        s = replace(s, reservation=Reservation(worker, kv_tokens, until, arm.token))
        # The lapse timer first, as for a tool wait: a refused reservation can then cancel it.
        return Step(s, (*cmds, Count("retentions", "reserve"), arm, Reserve(worker, kv_tokens, until, arm.token)))

    def _tool_wait(self, s: SessionState, tenant: str, worker: WorkerId, now: float, tools: tuple[str, ...],
                   kv_tokens: int, learned: Learned, cmds: list[Command], parked_budget: int | None) -> Step:
        if not self.params.plan_waits:
            return Step(replace(s, lifecycle=s.lifecycle.on(Event.TOOL_CALLS, now, tools=tools)), tuple(cmds))
        plan = learned.waits.plan(tenant, tools, now)
        label = plan.action
        if plan.action == "reserve" and parked_budget is not None and kv_tokens > parked_budget:
            plan, label = learned.waits.released(plan, now), "over_budget"
        s = replace(s, lifecycle=s.lifecycle.on(Event.TOOL_CALLS, now, tools=tools, plan=plan))
        cmds.append(Count("wait_plans", label))
        if plan.action == "reserve":
            s, arm = self._arm(s, LAPSE, plan.deadline)
            s = replace(s, reservation=Reservation(worker, kv_tokens, plan.deadline, arm.token))
            # The lapse timer first: a refused reservation (reservation_refused) can then cancel it.
            cmds += [arm, Reserve(worker, kv_tokens, plan.deadline, arm.token)]
        elif plan.prefetch_at is not None:
            s, arm = self._arm(s, PREFETCH, plan.prefetch_at)
            cmds.append(arm)
        return Step(s, tuple(cmds))

    def reservation_refused(self, s: SessionState, *, token: int, learned: Learned) -> Step:
        """The fleet store refused reservation ``token`` (the tenant's parked KV reached its budget on
        another replica meanwhile): the record drops it, so it never claims KV the store does not hold,
        and the wait takes the release path, as it would have had the controller known."""
        r = s.reservation
        if r is None or r.token != token:
            return Step(s)  # the wait is over already (the next request released it)
        kept = s.lifecycle.state is State.AWAITING_USER
        cmds: list[Command] = [Count("retentions", "refused") if kept else Count("tool_waits", "reservation_refused")]
        if s.timer(LAPSE) == token:
            s = s.without_timer(LAPSE)
            cmds.append(CancelTimers((LAPSE,)))
        s = replace(s, reservation=None)
        life = s.lifecycle
        if life.state is not State.AWAITING_TOOL or life.plan is None:
            return Step(s, tuple(cmds))
        plan = learned.waits.released(life.plan, life.since)
        s = replace(s, lifecycle=replace(life, plan=plan))
        if plan.prefetch_at is not None:
            s, arm = self._arm(s, PREFETCH, plan.prefetch_at)
            cmds.append(arm)
        return Step(s, tuple(cmds))

    @staticmethod
    def _settle_prefill(p: PendingPrefill | None, cached_tokens: int | None) -> list[Command]:
        if p is None:
            return []
        cmds: list[Command] = [CancelPrefill(p.worker, p.token)] if p.running else []
        if cached_tokens is not None and cached_tokens > p.divergence:
            return [*cmds, Count("prefills", "used"), Count("prefill_saved_ms", amount=p.gain_ms)]
        return [*cmds, Count("prefills", "wasted")]

    @staticmethod
    def _feedback(s: SessionState) -> list[Command]:
        cmds: list[Command] = []
        w = s.pending_wait
        if w is not None:
            cmds += [Observe(WaitObserved(w.tenant, w.tools, w.waited_s, w.predicted_s)),
                     Count("tool_waits", "overrun" if w.waited_s > w.predicted_s else "within")]
        a = s.pending_continue
        if a is not None:
            cmds.append(Observe(ContinuationObserved(a.tenant, a.size, True)))
        return cmds

    @staticmethod
    def _arm(s: SessionState, kind: str, due: float) -> tuple[SessionState, ArmTimer]:
        token = s.seq + 1
        return replace(s, seq=token).with_timer(kind, token), ArmTimer(kind, due, token)

    # -- timers ------------------------------------------------------------------------------------
    def fired(self, s: SessionState, *, kind: str, token: int, home: WorkerId | None) -> Step:
        if s.timer(kind) != token:
            return Step(s)  # stale: the wait it belonged to is over, or another timer replaced it
        s = s.without_timer(kind)
        if kind == LAPSE:
            r = s.reservation
            if r is None or r.token != token:
                return Step(s)
            kept = s.lifecycle.state is State.AWAITING_USER  # an answer's retention, not a tool wait's
            lapsed = (Unreserve(r.worker, r.tokens),
                      Count("retentions", "lapsed") if kept else Count("tool_waits", "reservation_lapsed"))
            return Step(replace(s, reservation=None), lapsed)
        if kind == PREFETCH:
            ok = s.lifecycle.state is State.AWAITING_TOOL and home is not None
            return Step(s, (Prefetch(home),) if ok and home is not None else ())
        if kind == SETTLE:
            return self._settled(s)
        if kind == PREFILL and s.lifecycle.state is State.AWAITING_USER and home is not None:
            # Kept armed until the prefill is decided against or done (a re-run after a replica died).
            worker = s.prefill.worker if s.prefill is not None and s.prefill.token == token else home
            return Step(s.with_timer(PREFILL, token), (ComputePrefix(worker, token),))
        return Step(s)

    @staticmethod
    def _settled(s: SessionState) -> Step:
        if s.answer is None:
            return Step(s)
        a = s.answer
        cmds: list[Command] = [Observe(ContinuationObserved(a.tenant, a.size, False))]
        p = s.prefill
        if p is not None:
            cmds += ([CancelPrefill(p.worker, p.token)] if p.running else []) + [Count("prefills", "wasted")]
        return Step(replace(s, answer=None, prefill=None), tuple(cmds))

    # -- background prefill ------------------------------------------------------------------------
    def prefix_ready(self, s: SessionState, *, token: int, worker: WorkerId, divergence: int, prefix_tokens: int,
                     block_size: int, pending_requests: int, kv_usage: float, cost: CostParams,
                     learned: Learned, prefill_budget: float | None = None) -> Step:
        """The next turn's prefix (``prefix_tokens`` long) shares ``divergence`` tokens with what the
        worker cached: decide whether to prefill it there. ``prefill_budget``: the background-prefill
        tokens the tenant has left now (None: no budget). The prefill timer stays armed until the
        prefill is done, so if the replica running it dies, the replica that claims the timer next runs
        it again."""
        answer = s.answer
        if s.timer(PREFILL) != token or answer is None or s.lifecycle.state is not State.AWAITING_USER:
            return Step(s)
        # The continuation is counted under the size the next turn would carry (the canonical prefix),
        # now that it is known, rather than the context at the answer (which still holds its reasoning).
        answer = replace(answer, size=prefix_tokens)
        s = replace(s, answer=answer)
        gain = gain_tokens(divergence, prefix_tokens, block_size)
        p = learned.continues.p(answer.tenant, answer.size)
        d = decide(self.params.prefill, gain, p, pending_requests=pending_requests, kv_usage=kv_usage,
                   budget=prefill_budget)
        cmds: list[Command] = [Count("prefill_decisions", d.reason)]
        if not d.issue:
            return Step(s.without_timer(PREFILL), tuple(cmds))
        old = s.prefill
        if old is not None and old.token != token:  # an older one nobody used
            cmds += ([CancelPrefill(old.worker, old.token)] if old.running else []) + [Count("prefills", "wasted")]
        gain_ms = cost.p1_ms * gain + cost.p_attn_ms * gain * divergence / 1e6
        cmds += [IssuePrefill(worker, token, gain), Count("prefills", "issued")]
        return Step(replace(s, prefill=PendingPrefill(worker, divergence, gain_ms, token)), tuple(cmds))

    def prefill_done(self, s: SessionState, *, token: int, ok: bool) -> Step:
        cmds = (Count("prefills", "completed" if ok else "failed"),)
        if s.timer(PREFILL) == token:
            s = s.without_timer(PREFILL)
        p = s.prefill
        if p is None or p.token != token or not p.running:
            return Step(s, cmds)
        return Step(replace(s, prefill=replace(p, running=False)), cmds)
