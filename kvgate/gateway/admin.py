"""The admin API: the cost model's parameters (read, validated swap), workers, tiers and the session
runtime, a conversation's record and its next-turn prefix."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from kvgate.errors import ApiError, error_body
from kvgate.gateway.auth import Principal, require
from kvgate.gateway.prepare import read_json
from kvgate.kvstore.codec import to_map
from kvgate.kvstore.conversations import StoreError
from kvgate.router.types import ConversationId
from kvgate.session.conversation import Conversation

if TYPE_CHECKING:
    from kvgate.gateway.parts import Parts

log = logging.getLogger(__name__)


def _error(status: int, message: str, type_: str, param: str | None = None, code: str | None = None
           ) -> JSONResponse:
    return JSONResponse(error_body(message, type_, param, code), status_code=status)


def conversation_view(c: Conversation) -> dict[str, Any]:
    return {"conversation_id": c.id, "tenant": c.tenant, "id_source": c.id_source, "home_worker": c.home,
            "created": c.created, "last_activity": c.last_activity, "turn_count": c.turn_count,
            "lifecycle": c.session.lifecycle.to_json(), "model": c.model, "history_messages": len(c.history),
            "exact_replies": len(c.exact), "chain_tokens": len(c.chain.tokens) if c.chain is not None else 0,
            "responses": list(c.responses), "version": c.version, "agent_metrics": agent_metrics(c),
            "reset": c.reset or None,
            "reservation": _reservation(c),
            "turns": [{**to_map(t), "uncached_prefill_tokens": t.uncached_prefill_tokens,
                       "active_context_tokens": t.active_context_tokens} for t in c.turns]}


def _reservation(c: Conversation) -> dict[str, Any] | None:
    """The KV held for the conversation on its home worker (a short tool wait, or an answer that asked for
    retention: docs/tiering.md)."""
    r = c.session.reservation
    return None if r is None else {"worker": r.worker, "tokens": r.tokens, "until": r.until}


def agent_metrics(c: Conversation) -> dict[str, Any]:
    """The metrics for agents of one conversation (docs/operations.md): token sums over all its turns,
    the context and KV its last turn left on the worker, TTFT and TPOT over all turns (mean) and over
    the turns kept (median, max)."""
    t = c.totals
    last = c.turns[-1] if c.turns else None

    def timing(total: float, n: int, kept: list[float], latest: float | None) -> dict[str, float | None]:
        kept = sorted(kept)
        return {"mean": total / n if n else None, "p50": kept[len(kept) // 2] if kept else None,
                "max": kept[-1] if kept else None, "last": latest}

    return {
        "turns": t.turns, "prompt_tokens": t.prompt_tokens, "cached_input_tokens": t.cached_input_tokens,
        "uncached_prefill_tokens": t.uncached_prefill_tokens, "recomputed_history_tokens": t.recomputed_history_tokens,
        "reuse_ratio": t.cached_input_tokens / t.prompt_tokens if t.prompt_tokens else None,
        "active_context_tokens": last.active_context_tokens if last is not None else 0,
        "kv_bytes": last.kv_bytes if last is not None else 0,
        "ttft_s": timing(t.ttft_s, t.ttft_count, [x.ttft_s for x in c.turns if x.ttft_s is not None],
                         last.ttft_s if last is not None else None),
        "tpot_s": timing(t.tpot_s, t.tpot_count, [x.tpot_s for x in c.turns if x.tpot_s is not None],
                         last.tpot_s if last is not None else None)}


def admin_routes(gw: Parts) -> APIRouter:
    r = APIRouter(prefix="/admin")
    add_policy_routes(r, gw)
    add_tier_routes(r, gw)
    add_worker_routes(r, gw)
    add_conversation_routes(r, gw)
    return r


def _operator(gw: Parts, request: Request) -> Principal:
    return require(gw.auth, request.headers, operator=True)


def _policy_view(gw: Parts) -> dict[str, Any]:
    rt = gw.runtime
    return {"policy": gw.policy.name, "version": gw.policy_sync.version, "cost": gw.cost.params.model_dump(),
            "waits": rt.learned.waits.params.model_dump(), "prefill": rt.controller.params.prefill.model_dump(),
            # Which learned cost parameters an operator pinned (a PATCH with null gives them back).
            "rate_sources": gw.tiers.rate_sources()}


def add_policy_routes(r: APIRouter, gw: Parts) -> None:
    @r.get("/policy")
    async def get_policy(request: Request) -> dict[str, Any]:
        _operator(gw, request)
        return _policy_view(gw)

    @r.patch("/policy")
    async def patch_policy(request: Request) -> JSONResponse:
        """Change cost-model, tool-wait and background-prefill parameters at run time (what ``kvgate tune``
        proposes): every section given is validated whole, then all are swapped in at once."""
        who = _operator(gw, request)
        changes = await read_json(request, 64 * 1024, gw.settings.hostile.json_limits)
        sections = {k: v for k, v in changes.items() if k != "reason"} if isinstance(changes, dict) else changes
        reason = changes.get("reason") if isinstance(changes, dict) else None
        try:
            # Validated whole, then swapped in at once (kvgate/gateway/policyedit.py, shared with gRPC).
            # Versioned in the shared store first, so every replica applies it (gateway/policysync.py).
            change = await gw.policy_sync.publish(sections, _who(request, who), "http", str(reason or ""))
        except ApiError as exc:
            return exc.response()
        log.info("policy parameters changed by %s: %s", change.who, sections)
        return JSONResponse(_policy_view(gw))


def add_tier_routes(r: APIRouter, gw: Parts) -> None:
    @r.get("/tiers")
    async def tiers(request: Request) -> dict[str, Any]:
        """Tool-wait predictions, tier adapters' state, background prefill counters."""
        _operator(gw, request)
        try:
            await gw.runtime.tick()  # observations published a moment ago count
        except StoreError as exc:
            log.warning("/admin/tiers without a fresh tick: %s", exc)  # the last tick's view is still an answer
        snap = gw.runtime.snapshot()
        reserved = {w.id: w.reserved for w in gw.pool.all() if w.reserved}
        return {**gw.tiers.snapshot(), "waits": snap["waits"], "reserved": reserved,
                "prefill": {**snap["prefill"], "continuation": snap["continuation"]}}


def add_worker_routes(r: APIRouter, gw: Parts) -> None:
    @r.get("/workers")
    async def workers(request: Request) -> dict[str, Any]:
        _operator(gw, request)
        return {"workers": [{"id": w.id, "url": w.config.url, "model": w.config.model, "engine": w.config.engine,
                             "healthy": w.healthy, "in_flight": w.in_flight, "running": w.running,
                             "waiting": w.waiting, "kv_usage": w.kv_usage, "reserved_tokens": w.reserved,
                             "node": w.config.node, "last_error": w.last_error}
                            for w in gw.pool.all()]}


def add_conversation_routes(r: APIRouter, gw: Parts) -> None:
    # next-prefix first: the record's `{cid:path}` would otherwise swallow it.
    @r.get("/conversations/{cid:path}/next-prefix")  # scoped ids ("tenant/id") hold a slash
    async def next_prefix(cid: str, request: Request) -> JSONResponse:
        """The canonical prefix the conversation's next request will start with (for background prefill).
        Operators only: it hands out the conversation's token ids."""
        _operator(gw, request)
        conv = await _peek(gw, cid)
        if isinstance(conv, JSONResponse):
            return conv
        if conv is None or not conv.history:
            return _error(404, f"conversation `{cid}` has no completed turn", "not_found_error", "id")
        try:
            proto = gw.turns.protocol(conv.model, conv.tenant, request.query_params.get("reasoning_policy"))
        except ApiError as exc:
            return exc.response()
        tokens = gw.turns.next_turn_prefix(conv, proto)
        if tokens is None:
            return _error(409, f"model `{conv.model}` has no local tokenizer", "invalid_request_error", None,
                          "no_local_tokenizer")
        return JSONResponse({"conversation_id": cid, "model": conv.model, "policy": str(proto.policy),
                             "tokens": len(tokens), "token_ids": tokens})

    @r.get("/conversations/{cid:path}")
    async def conversation(cid: str, request: Request) -> JSONResponse:
        """A conversation's record: an operator's any, a tenant's its own (by its full id or the id it
        sent, without the ``tenant/`` scope); another tenant's is not found, as if it did not exist."""
        caller = require(gw.auth, request.headers)
        conv = await _peek(gw, f"{caller.tenant}/{cid}") if gw.auth.settings.enabled and not caller.operator \
            else None
        if conv is None:
            conv = await _peek(gw, cid)
        if isinstance(conv, JSONResponse):
            return conv
        if conv is not None and gw.auth.settings.enabled and not caller.operator and conv.tenant != caller.tenant:
            conv = None
        if conv is None:
            return _error(404, f"conversation `{cid}` not found", "not_found_error", "id")
        return JSONResponse(conversation_view(conv))


def _who(request: Request, caller: Principal) -> str:
    """Who made an admin change, for the policy log: the credential's name and the peer address."""
    return f"{caller.name}@{request.client.host if request.client else 'unknown'}"


async def _peek(gw: Parts, cid: str) -> Conversation | JSONResponse | None:
    try:
        return await gw.store.peek(ConversationId(cid))
    except StoreError as exc:
        return _error(503, str(exc), "service_unavailable", None, "session_store_unavailable")
