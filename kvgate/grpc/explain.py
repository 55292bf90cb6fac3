"""Where a request would go and why, without sending it: the request is prepared exactly as the HTTP front
prepares it (``Preparer.prepare_body(act=False)``: no session controller command runs), the routing inputs
gathered once (``Router.plan``) and the policy asked (``Router.pick(observe=False)``: nothing counted, no
listener told). No worker slot is taken and nothing is written."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from kvgate import safejson
from kvgate.epp.endpoints import endpoint_of, outside
from kvgate.errors import PayloadTooLarge, ServiceUnavailable
from kvgate.gateway.auth import Principal
from kvgate.gateway.exchange import Endpoint, Prepared
from kvgate.gateway.prepare import parse_object
from kvgate.gateway.route import Plan
from kvgate.grpc.gen.kvgate.v1 import routing_pb2 as pb
from kvgate.router.cost import CostModel
from kvgate.router.types import Decision, RouteRequest, WorkerId, WorkerView

if TYPE_CHECKING:
    from kvgate.gateway.parts import Parts


async def parse_body(text: str, limit: int, limits: safejson.JsonLimits = safejson.DEFAULT_LIMITS) -> dict[str, Any]:
    if len(text) > limit:
        raise PayloadTooLarge(f"Request body of {len(text)} bytes exceeds the limit of {limit} bytes.",
                              param="body_json", code="request_too_large")
    # As the HTTP front parses: a large body in a thread, not on the loop the gateway's requests share.
    return await parse_object(text.encode(), limits, what="body_json", param="body_json")


def endpoint_name(e: pb.Endpoint.ValueType) -> Endpoint:
    return "completions" if e == pb.ENDPOINT_COMPLETIONS else "chat"


def decision_pb(gw: Parts, d: Decision) -> pb.Decision:
    return pb.Decision(worker=d.worker, endpoint=endpoint_of(gw.pool.get(d.worker).config),
                       policy=gw.policy.name, reason=d.reason, tier=d.tier, bounded=d.bounded,
                       expected_cached_tokens=d.expected_cached_tokens,
                       expected_loaded_tokens=d.expected_loaded_tokens)


async def explain(gw: Parts, req: pb.ExplainRequest) -> pb.ExplainResponse:
    body = await parse_body(req.body_json, gw.settings.max_body_bytes, gw.settings.hostile.json_limits)
    headers = {k.lower(): v for k, v in req.headers.items()}
    # Auth on, only an operator reaches here; it explains a request as the tenant its headers name, so
    # the request is identified and salted as that tenant's own would be.
    as_tenant = Principal("explain", headers.get(gw.settings.tenant_header.lower(), ""), "tenant", "anonymous") \
        if gw.auth.settings.enabled else None
    p = await gw.proxy.preparer.prepare_body(body, headers, endpoint_name(req.endpoint), act=False,
                                             principal=as_tenant)
    plan = await gw.router.plan(p)
    fleet = gw.pool.snapshot(p.model)
    excluded = {WorkerId(w) for w in req.exclude_workers}
    subset = list(req.endpoint_subset) or None
    off_subset = outside(subset, (gw.pool.get(w.id).config for w in fleet.workers))
    decision = gw.router.pick(p, plan, excluded | off_subset, observe=False)
    if decision is None:
        raise ServiceUnavailable(f"No healthy worker for model `{p.model}`.", code="no_healthy_worker")
    route = gw.router.route_request(p, plan, excluded | off_subset)
    return pb.ExplainResponse(
        decision=decision_pb(gw, decision), model=p.model,
        candidates=candidates(gw, route, fleet.workers, plan, decision, excluded, off_subset),
        conversation=_conversation(p), prompt=pb.PromptInfo(tokens=p.prompt.length, source=p.prompt.source,
                                                            block_size=plan.block_size,
                                                            forwarded_bytes=len(p.payload)),
        history=_history(p))


def candidates(gw: Parts, route: RouteRequest, workers: Sequence[WorkerView], plan: Plan, decision: Decision,
               excluded: set[WorkerId], off_subset: set[WorkerId]) -> list[pb.Candidate]:
    """Every worker of the model with what the policy read of it; cost-model charges when it routes."""
    cost = gw.policy if isinstance(gw.policy, CostModel) else None
    live = [w for w in workers if w.healthy and w.id not in route.exclude]
    waiting = sum(w.pending_requests for w in live) / len(live) if live else 0.0
    out = []
    for w in workers:
        c = pb.Candidate(worker=w.id, endpoint=endpoint_of(gw.pool.get(w.id).config), healthy=w.healthy,
                         left_out=_left_out(w, excluded, off_subset, decision.scores, cost is not None),
                         in_flight=w.in_flight, pending_prefill_tokens=w.pending_prefill_tokens)
        if cost is not None:
            r = cost.reuse(route, w)
            c.expected.CopyFrom(pb.TierTokens(gpu=r.gpu, cpu=r.cpu, remote=r.remote))
            if not c.left_out:
                c.ttft_ms = cost.ttft_ms(route, w)
                c.delay_to_others_ms = cost.params.externality_weight * cost.delay_to_others_ms(route, w)
                c.reservation_ms = cost.reservation_ms(route, w)
                c.backlog_ms = cost.backlog_ms(route, w, waiting)
                c.move_ms = cost.move_ms(route, w)
        else:
            c.expected.CopyFrom(pb.TierTokens(gpu=plan.matched_tokens(w.id)))
        if w.id in decision.scores:
            c.score = decision.scores[w.id]
        out.append(c)
    return out


def _left_out(w: WorkerView, excluded: set[WorkerId], off_subset: set[WorkerId], scores: Mapping[WorkerId, float],
              scored: bool) -> str:
    if w.id in excluded:
        return "excluded"
    if w.id in off_subset:
        return "not_in_subset"
    if not w.healthy:
        return "unhealthy"
    if scored and scores and w.id not in scores:
        return "bounded_load"
    return ""


def _conversation(p: Prepared) -> pb.ConversationRef:
    conv = p.conv
    return pb.ConversationRef(id=p.ident.conversation_id, source=p.ident.source, tenant=p.ident.tenant,
                              known=conv is not None, home_worker=(conv.home or "") if conv is not None else "",
                              turn_count=conv.turn_count if conv is not None else 0)


def _history(p: Prepared) -> pb.HistoryInfo | None:
    t = p.turn
    if t is None:
        return None
    h = pb.HistoryInfo(reasoning_policy=str(t.protocol.policy), restored=len(t.canonical.restored),
                       reasoning_changed=len(t.canonical.reasoning_changed))
    if t.loss is not None:
        h.reusable_tokens, h.kept_tokens, h.lost_tokens = t.loss.reusable, t.loss.best, t.loss.lost
        h.loss_cause, h.loss_detail = t.loss.cause or "", t.loss.detail
    return h
