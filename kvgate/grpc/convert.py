"""kvgate's records as ``kvgate.v1`` messages."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from kvgate.epp.endpoints import endpoint_of
from kvgate.gateway.policyedit import PolicyChange
from kvgate.gateway.workers import WorkerState
from kvgate.grpc.gen.kvgate.v1 import conversations_pb2 as cpb
from kvgate.grpc.gen.kvgate.v1 import fleet_pb2 as fpb
from kvgate.grpc.gen.kvgate.v1 import policy_pb2 as ppb
from kvgate.router.cost import CostParams
from kvgate.session.conversation import Conversation, TurnRecord
from kvgate.session.lifecycle import Lifecycle

if TYPE_CHECKING:
    from kvgate.gateway.parts import Parts


def lifecycle_pb(lc: Lifecycle) -> cpb.Lifecycle:
    out = cpb.Lifecycle(state=lc.state.value, since=lc.since, in_flight=lc.in_flight, before=lc.before.value,
                        tools=list(lc.tools))
    if lc.plan is not None:
        out.plan.CopyFrom(cpb.WaitPlan(predicted_s=lc.plan.predicted_s, action=lc.plan.action,
                                       deadline=lc.plan.deadline, prefetch_at=lc.plan.prefetch_at))
    return out


def turn_pb(t: TurnRecord) -> cpb.Turn:
    return cpb.Turn(worker=t.worker, reason=t.reason, prompt_tokens=t.prompt_tokens, cached_tokens=t.cached_tokens,
                    completion_tokens=t.completion_tokens, ttft_s=t.ttft_s,
                    expected_cached_tokens=t.expected_cached_tokens, tier=t.tier, lost_tokens=t.lost_tokens,
                    loss_cause=t.loss_cause or "", loss_detail=t.loss_detail,
                    cache_lost_tokens=t.cache_lost_tokens, cache_loss_cause=t.cache_loss_cause or "", at=t.at)


def conversation_pb(c: Conversation, turns: bool) -> cpb.Conversation:
    return cpb.Conversation(
        conversation_id=c.id, tenant=c.tenant, id_source=c.id_source, home_worker=c.home or "", created=c.created,
        last_activity=c.last_activity, turn_count=c.turn_count, model=c.model,
        lifecycle=lifecycle_pb(c.session.lifecycle), history_messages=len(c.history), exact_replies=len(c.exact),
        chain_tokens=len(c.chain.tokens) if c.chain is not None else 0, responses=list(c.responses),
        version=c.version, turns=[turn_pb(t) for t in c.turns] if turns else [])


def cost_pb(p: CostParams) -> ppb.CostParams:
    return ppb.CostParams(**p.model_dump())


def cost_changes(msg: ppb.CostParams) -> dict[str, float | int | str]:
    """The fields an update sets (proto3 ``optional``: presence is what was asked)."""
    return {f.name: v for f, v in msg.ListFields()}


def change_pb(c: PolicyChange) -> ppb.PolicyChange:
    return ppb.PolicyChange(time=c.at, who=c.who, via=c.via, reason=c.reason, version=c.version,
                            changes=[ppb.FieldChange(field=f.field, old_value=_number(f.old), new_value=_number(f.new))
                                     for f in c.changes])


def _number(v: object) -> float:
    return float(v) if isinstance(v, (int, float)) else math.nan


def worker_pb(gw: Parts, w: WorkerState) -> fpb.Worker:
    c = w.config
    spec = w.hash_spec(gw.settings.hash_seed)
    ep = gw.subscriber.endpoints.get(w.id)
    return fpb.Worker(
        id=w.id, url=c.url, endpoint=endpoint_of(c), model=c.model, engine=c.engine, node=c.node, healthy=w.healthy,
        health=w.health.state.value, joining=w.joining, draining=w.draining, last_error=w.last_error,
        in_flight=w.in_flight, pending_prefill_tokens=w.pending_prefill, pending_requests=w.pending_requests,
        decode_requests=w.decode_requests, running=w.running, waiting=w.waiting, kv_usage=w.kv_usage,
        reserved_tokens=w.reserved, kv_capacity_tokens=c.kv_capacity_tokens or w.kv_capacity,
        index=fpb.IndexSize(gpu_blocks=gw.prefix.index.block_count(w.id, "GPU"),
                            cpu_blocks=gw.prefix.index.block_count(w.id, "CPU")),
        events=fpb.EventStream(subscribed=ep is not None, endpoint=ep[0] if ep else "",
                               replay_endpoint=(ep[1] or "") if ep else "", stale=gw.prefix.events.stale(w.id)),
        block_size=spec.block_size, hash_algo=spec.algo)
