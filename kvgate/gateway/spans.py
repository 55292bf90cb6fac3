"""What each span of a request's trace says (``tracing.py`` makes the spans): GenAI semantic-convention
attributes where the conventions have one (``gen_ai.*``, ``server.*``, ``error.type``; the GenAI registry
as of semantic-conventions-genai, 2026), ``kvgate.*`` for the rest. Pure functions of the request's own
objects; nothing here is called when tracing is off."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

if TYPE_CHECKING:
    from kvgate.config import WorkerConfig
    from kvgate.gateway.exchange import Exchange, Prepared
    from kvgate.gateway.route import Plan
    from kvgate.router.types import Decision
    from kvgate.session.conversation import TurnRecord

Attributes = dict[str, Any]


def operation(p: Prepared) -> str:
    return "chat" if p.endpoint == "chat" else "text_completion"


def request_attributes(p: Prepared) -> Attributes:
    return {"gen_ai.operation.name": operation(p), "gen_ai.request.model": p.model,
            "gen_ai.conversation.id": p.ident.conversation_id, "gen_ai.request.stream": p.stream,
            "kvgate.tenant": p.ident.tenant, "kvgate.conversation.source": p.ident.source}


def step_attributes(name: str, p: Prepared) -> Attributes:
    if name == "identify":
        conv = p.conv
        return {"gen_ai.conversation.id": p.ident.conversation_id, "kvgate.conversation.source": p.ident.source,
                "kvgate.tenant": p.ident.tenant, "kvgate.conversation.known": conv is not None,
                "kvgate.conversation.turns": conv.turn_count if conv is not None else 0,
                "kvgate.conversation.home": (conv.home if conv is not None else None) or ""}
    if name == "canonicalise" and p.turn is not None:
        c = p.turn.canonical
        return {"kvgate.history.policy": str(p.turn.protocol.policy), "kvgate.history.protocol": p.turn.protocol.name,
                "kvgate.history.messages": len(c.messages), "kvgate.history.restored": len(c.restored),
                "kvgate.history.reasoning_changed": len(c.reasoning_changed)}
    if name == "tokenize":
        out: Attributes = {"kvgate.prompt.tokens": p.prompt.length, "kvgate.prompt.tokenizer": p.prompt.source,
                           "kvgate.prompt.reused_blocks": p.prompt.reused_blocks}
        loss = p.turn.loss if p.turn is not None else None
        if loss is not None:
            out.update({"kvgate.prefix.reusable_tokens": loss.reusable, "kvgate.prefix.expected_tokens": loss.best,
                        "kvgate.prefix.lost_tokens": loss.lost, "kvgate.prefix.loss_cause": loss.cause or "none"})
        return out
    if name == "session":
        return {"kvgate.session.user_turn": p.user_turn, "kvgate.session.commands": len(p.arrival.commands),
                "kvgate.session.forced_worker": p.arrival.force or ""}
    return {}


def route_attributes(p: Prepared, plan: Plan, d: Decision | None, policy: str) -> Attributes:
    out: Attributes = {"kvgate.route.policy": policy, "kvgate.route.best_matched_tokens": plan.best_matched_tokens,
                       "kvgate.route.remote_tier_tokens": plan.remote}
    if d is None:
        return {**out, "kvgate.route.reason": "no_worker"}
    loaded = d.expected_loaded_tokens
    out.update({
        "kvgate.route.worker": d.worker, "kvgate.route.reason": d.reason, "kvgate.route.tier": d.tier,
        "kvgate.route.bounded": d.bounded, "kvgate.route.expected_cached_tokens": d.expected_cached_tokens,
        "kvgate.route.expected_cached_tokens.gpu": d.expected_cached_tokens - loaded,
        "kvgate.route.expected_cached_tokens.cpu": loaded - d.expected_remote_tokens,
        "kvgate.route.expected_cached_tokens.remote": d.expected_remote_tokens,
        "kvgate.route.candidates": len(d.scores)})
    if d.worker in d.scores:
        out["kvgate.route.score_ms"] = d.scores[d.worker]
    others = sorted((s, w) for w, s in d.scores.items() if w != d.worker)
    if others:
        out["kvgate.route.runner_up"] = others[0][1]
        out["kvgate.route.runner_up_score_ms"] = others[0][0]
    return out


def upstream_attributes(ex: Exchange, worker: WorkerConfig) -> Attributes:
    p, u = ex.prepared, urlparse(worker.url)
    return {"gen_ai.operation.name": operation(p), "gen_ai.provider.name": worker.engine,
            "gen_ai.request.model": p.model, "gen_ai.request.stream": p.stream,
            "gen_ai.conversation.id": p.ident.conversation_id, "server.address": u.hostname or "",
            "server.port": u.port or (443 if u.scheme == "https" else 80), "kvgate.worker": ex.decision.worker,
            "kvgate.expected_cached_tokens": ex.decision.expected_cached_tokens}


def response_attributes(ex: Exchange) -> Attributes:
    out: Attributes = {}
    if ex.response_id:
        out["gen_ai.response.id"] = ex.response_id
    u = ex.usage
    if u is not None:
        out.update({"gen_ai.usage.input_tokens": u.prompt_tokens, "gen_ai.usage.output_tokens": u.completion_tokens,
                    "gen_ai.usage.cache_read.input_tokens": u.cached_tokens})
    if ex.prepared.turn is not None and ex.reply.complete:
        tools = ex.reply.tool_names()
        out["gen_ai.response.finish_reasons"] = ["tool_calls" if tools else "stop"]
        if tools:
            out["kvgate.reply.tools"] = list(tools)
    return out


def relay_attributes(ex: Exchange, outcome: str) -> Attributes:
    out: Attributes = {"kvgate.relay.outcome": outcome}
    d, u = ex.decode, ex.usage
    if d is not None:
        out["kvgate.relay.output_events"] = d.events + 1
        out["kvgate.decode_s"] = d.last - d.first
        if u is not None and u.completion_tokens > 1:
            out["kvgate.tpot_s"] = (d.last - d.first) / (u.completion_tokens - 1)
    return out


def record_attributes(t: TurnRecord) -> Attributes:
    out: Attributes = {"kvgate.turn.cached_tokens": t.cached_tokens,
                       "kvgate.turn.uncached_prefill_tokens": max(0, t.prompt_tokens - t.cached_tokens),
                       "kvgate.turn.active_context_tokens": t.prompt_tokens + t.completion_tokens,
                       "kvgate.turn.recomputed_history_tokens": t.recomputed_tokens}
    if t.loss_cause:
        out.update({"kvgate.loss.cause": t.loss_cause, "kvgate.loss.tokens": t.lost_tokens})
    if t.cache_loss_cause:
        out.update({"kvgate.cache_loss.cause": t.cache_loss_cause, "kvgate.cache_loss.tokens": t.cache_lost_tokens})
    if t.kv_bytes:
        out["kvgate.turn.kv_bytes"] = t.kv_bytes
    return out


def clean(attributes: Mapping[str, Any]) -> Attributes:
    """Attributes without None values (OpenTelemetry drops them with a warning)."""
    return {k: v for k, v in attributes.items() if v is not None}
