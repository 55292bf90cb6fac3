"""A completed request's outcome, recorded: its metrics, the cause of every lost prefix token, and one
compare-and-set write of the conversation's record — the turn, the reply and its chain, the tier estimate,
and the session controller's arrival and completion steps — then the controller's commands.

Only a completed response writes state; a failed or rejected request leaves the record as it was. The
controller's steps are applied to the record as it is at write time (re-applied when another request or
replica wrote first), so parallel branches of one conversation never lose each other's turns.
"""

from __future__ import annotations

import asyncio
import logging
import time
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from kvgate.gateway.exchange import Exchange, Usage
from kvgate.gateway.runtime import SessionRuntime
from kvgate.gateway.telemetry import GatewayMetrics, tpot_of
from kvgate.gateway.tierview import TierView
from kvgate.gateway.turns import TurnService
from kvgate.history.loss import explain_cache
from kvgate.kvstore.conversations import StoreError
from kvgate.kvstore.grouping import GroupingIndex
from kvgate.session import regroup
from kvgate.session.controller import Command
from kvgate.session.conversation import Chain, Conversation, Message, TurnRecord

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _Loss:
    lost: int = 0
    cause: str | None = None
    detail: str = ""
    cache_lost: int = 0
    cache_cause: str | None = None


class Recorder:
    def __init__(self, runtime: SessionRuntime, turns: TurnService, tiers: TierView, metrics: GatewayMetrics,
                 policy_name: str, grouping: GroupingIndex | None = None) -> None:
        self.grouping = grouping
        """Keyless conversations: each turn files its newest messages' digests (session/regroup.py)."""
        self.runtime = runtime
        self.turns = turns
        self.tiers = tiers
        self.metrics = metrics
        self.policy_name = policy_name

    async def record(self, ex: Exchange) -> None:
        ex.prepared.trace.mark("record")
        self._usage_metrics(ex)
        loss = self._loss(ex)
        self._agent_metrics(ex, loss)
        chain = await self._chain(ex)
        now = time.time()
        u = ex.usage or Usage(0, 0, 0)
        d = ex.decision
        trace_id, span_id = ex.prepared.trace.ids()
        turn = TurnRecord(d.worker, d.reason, u.prompt_tokens, u.cached_tokens, u.completion_tokens, ex.ttft_s,
                          d.expected_cached_tokens, d.tier, loss.lost, loss.cause, loss.detail, loss.cache_lost,
                          loss.cache_cause, now, trace_id=trace_id, span_id=span_id, **self._figures(ex, loss))
        p = ex.prepared
        if p.arrival_task is not None:
            await p.arrival_task  # the arrival's cancellations go before this turn's new timers
        # After the arrival: its release of this conversation's last reservation is counted out.
        parked = await self._parked_budget(ex, now)
        commands: list[Command] = []

        def fn(cur: Conversation | None) -> Conversation:
            new, cmds = self._next(cur, ex, turn, chain, now, parked)
            commands[:] = cmds
            return new

        try:
            # Compare-and-set: another request of this conversation (maybe on another replica) may have
            # written meanwhile; its turn is kept.
            conv = await self.runtime.store.update(p.ident.conversation_id, fn, known=p.conv)
        except StoreError as exc:
            self.metrics.session_store_errors.inc()
            log.warning("turn not recorded: %s", exc)
            return
        await self.runtime.execute(p.ident.conversation_id, conv, commands)
        p.trace.recorded(turn)
        await self._file(ex)

    async def _file(self, ex: Exchange) -> None:
        p = ex.prepared
        if self.grouping is None or p.turn is None or p.ident.source not in ("derived", "regrouped"):
            return
        reply = ex.reply.message() if ex.reply.complete else None
        digests = regroup.index_digests(p.turn.canonical.messages, reply, p.ident.alias)
        await self.grouping.add(p.ident.tenant, digests, p.ident.conversation_id)

    def _figures(self, ex: Exchange, loss: _Loss) -> dict[str, Any]:
        """The turn's figures for agents that the record keeps beside the usage (docs/operations.md)."""
        u = ex.usage
        context = u.prompt_tokens + u.completion_tokens if u is not None else 0
        return {"recomputed_tokens": loss.lost if loss.cause == "reasoning_dropped" else 0,
                "kv_bytes": self.metrics.kv_bytes_of(ex.prepared.model, context, ex.block_size),
                "tpot_s": tpot_of(ex.decode, u.completion_tokens) if u is not None else None}

    async def _parked_budget(self, ex: Exchange, now: float) -> int | None:
        """What the tenant may still park, read before the compare-and-set (its function is synchronous);
        only for a reply with tool calls or a request that asked for retention, of a tenant with a budget, so
        other requests pay no round trip."""
        budgets, tenant = self.runtime.budgets, ex.prepared.ident.tenant
        if budgets is None or budgets.parked_limit(tenant) is None or not (ex.reply.tool_names()
                                                                            or ex.prepared.retain_s):
            return None
        return await budgets.parked_left(tenant, now)

    def _next(self, cur: Conversation | None, ex: Exchange, turn: TurnRecord, chain: Chain | None, now: float,
              parked: int | None) -> tuple[Conversation, tuple[Command, ...]]:
        p, u, rt = ex.prepared, ex.usage, self.runtime
        base = cur or Conversation(p.ident.conversation_id, p.ident.tenant, p.ident.source, created=now)
        arrived = rt.controller.arrived(base.session, tenant=p.ident.tenant, now=p.arrived_at, user_turn=p.user_turn)
        ended = rt.controller.ended(
            arrived.state, tenant=p.ident.tenant, worker=ex.decision.worker, now=now, tools=ex.reply.tool_names(),
            kv_tokens=(u.prompt_tokens + u.completion_tokens) if u else p.prompt.length,
            cached_tokens=u.cached_tokens if u else None, learned=rt.learned, parked_budget=parked,
            retain_s=p.retain_s)
        conv = replace(base, session=ended.state,
                       residency=self.tiers.stored(base.residency, ex.node, p.prompt.length)
                       ).with_turn(turn, self.turns.limits)
        if p.turn is not None and ex.reply.complete:
            history = shared_prefix(p.turn.canonical.messages, base.history)
            conv = conv.with_reply(p.model, history, ex.reply.message(), p.turn.tools, chain,
                                   ex.response_id if p.store_response else None, self.turns.limits)
        return conv, ended.commands

    async def _chain(self, ex: Exchange) -> Chain | None:
        """The completed turn's chain, rendered and tokenized beside the event loop (long histories cost
        milliseconds of template and tokenizer work)."""
        p = ex.prepared
        if p.prompt_task is not None:
            await p.prompt_task
        if p.turn is None or not ex.reply.complete:
            return None
        chain = await asyncio.to_thread(self.turns.chain_for, p.model, p.turn.canonical.messages, ex.reply.message(),
                                        p.turn.tools, p.prompt.chain)
        if chain is not None and ex.engine_ids is not None:
            chain = replace(chain, engine=array("I", ex.engine_ids.chain))
        return chain

    def _usage_metrics(self, ex: Exchange) -> None:
        u, d = ex.usage, ex.decision
        if u is None:
            self.metrics.missing_usage.inc()
            return
        self.metrics.prompt_tokens.labels(d.worker).inc(u.prompt_tokens)
        self.metrics.cached_tokens.labels(d.worker).inc(u.cached_tokens)
        self.metrics.completion_tokens.labels(d.worker).inc(u.completion_tokens)
        self.metrics.expected_vs_actual.labels(self.policy_name).observe(u.cached_tokens - d.expected_cached_tokens)
        self.metrics.expected_cached.labels(self.policy_name).inc(d.expected_cached_tokens)

    def _agent_metrics(self, ex: Exchange, loss: _Loss) -> None:
        """The metrics for agents (docs/operations.md) of one completed request."""
        p = ex.prepared
        m, tenant = p.model, p.ident.tenant
        if ex.usage is not None:
            u = ex.usage
            context = u.prompt_tokens + u.completion_tokens
            self.metrics.add_cached_input(m, tenant, u.cached_tokens)
            self.metrics.add_uncached_prefill(m, tenant, max(0, u.prompt_tokens - u.cached_tokens))
            self.metrics.observe_active_context(m, context)
            self.metrics.observe_kv_bytes(m, context, ex.block_size)
            self.metrics.observe_tpot(m, ex.decode, u.completion_tokens)
        if loss.cause == "reasoning_dropped" and loss.lost > 0:
            self.metrics.add_recomputed_history(m, tenant, loss.lost)
        self.metrics.saw_conversation(m, p.ident.conversation_id)

    def _loss(self, ex: Exchange) -> _Loss:
        turn = ex.prepared.turn
        loss = turn.loss if turn is not None else None
        if loss is None:
            return _Loss()
        if loss.lost and loss.cause:
            self.metrics.tokens_lost.labels(loss.cause).inc(loss.lost)
        cache_lost, cache_cause = 0, None
        if ex.usage is not None:
            cache_lost, cache_cause = explain_cache(loss.best, ex.usage.cached_tokens, ex.chosen_matched_tokens,
                                                    ex.best_matched_tokens)
            if cache_lost and cache_cause:
                self.metrics.tokens_lost.labels(cache_cause).inc(cache_lost)
        return _Loss(loss.lost, loss.cause, loss.detail, cache_lost, cache_cause)


def shared_prefix(messages: Sequence[Message], held: tuple[Message, ...]) -> tuple[Message, ...]:
    """``messages`` with the leading ones equal to the record's own history replaced by the record's
    objects: the store then measures only the messages this turn added (it remembers its parts' sizes by
    identity), and one copy of the history is kept instead of the request's parse of it."""
    n = 0
    for a, b in zip(messages, held, strict=False):
        if a is not b and a != b:
            break
        n += 1
    return (*held[:n], *messages[n:]) if n else tuple(messages)
