"""The gateway's ASGI app: wiring of pool, policy, session store and proxy behind the HTTP routes."""

from __future__ import annotations

import json
import logging
import socket
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvgate.clock import Clock, MonotonicClock
from kvgate.config import GatewaySettings
from kvgate.errors import error_body
from kvgate.gateway.background_prefill import BackgroundPrefill
from kvgate.gateway.kvevents import KvEventSubscriber
from kvgate.gateway.prefix import PrefixKnowledge
from kvgate.gateway.prompts import PromptBuilder
from kvgate.gateway.proxy import Proxy
from kvgate.gateway.telemetry import GatewayMetrics, PrefixCollector
from kvgate.gateway.tiering import TierKeeper
from kvgate.gateway.turns import TurnKeeper
from kvgate.gateway.workers import WorkerPool
from kvgate.kvstore.redis_sessions import RedisSessionStore, SessionStoreError
from kvgate.kvstore.sessions import MemorySessionStore, SessionStore
from kvgate.router.cost import CostModel, CostParams
from kvgate.router.hashing import VllmHasher
from kvgate.router.policies import Policy, make_policy
from kvgate.router.types import ConversationId
from kvgate.tokens.tokenizer import ChatTokenizer

log = logging.getLogger(__name__)


def make_client(timeout: httpx.Timeout | float) -> httpx.AsyncClient:
    """An HTTP client for worker traffic. TCP_NODELAY matters: httpcore writes a request's headers and
    body separately, and on a reused connection Nagle's algorithm then holds the body until the peer's
    delayed ACK (~40 ms), which would add 40 ms to the TTFT of every turn after the first."""
    transport = httpx.AsyncHTTPTransport(
        socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)],
        limits=httpx.Limits(max_connections=2000, max_keepalive_connections=200),
    )
    return httpx.AsyncClient(timeout=timeout, transport=transport)


class Gateway:
    """Everything one gateway process owns; created per app, so tests can run several side by side."""

    def __init__(self, settings: GatewaySettings, clock: Clock | None = None,
                 sessions: SessionStore | None = None) -> None:
        self.settings = settings
        self.clock = clock or MonotonicClock()
        self.metrics = GatewayMetrics()
        timeout = httpx.Timeout(connect=settings.upstream_connect_timeout_s, read=settings.upstream_read_timeout_s,
                                write=30.0, pool=settings.upstream_connect_timeout_s)
        self.client = make_client(timeout)
        self.pool = WorkerPool(settings.workers, self.client, self.clock, settings.health_interval_s,
                               settings.health_timeout_s)
        self.cost = CostModel(settings.cost.model_copy())
        if settings.policy == "cost_model":
            self.policy: Policy = self.cost
        else:
            params = {"epsilon": settings.affinity_epsilon} if settings.policy == "session_affinity" else {}
            self.policy = make_policy(settings.policy, **params)
        if sessions is not None:
            self.sessions = sessions
        elif settings.session_store == "redis":
            self.sessions = RedisSessionStore(settings.redis_url, settings.session_ttl_s)
        else:
            self.sessions = MemorySessionStore(self.clock, settings.session_ttl_s, settings.max_sessions)
        self.prefix = PrefixKnowledge(settings.workers, settings.approx_ttl_s)
        self.subscriber = KvEventSubscriber(self.prefix.events, settings.workers, self.client)
        tokenizers = {m: ChatTokenizer(Path(d)) for m, d in settings.tokenizers.items()}
        hashers = {w.model: VllmHasher(w.block_size, w.hash_algo, settings.hash_seed) for w in settings.workers}
        self.prompts = PromptBuilder(tokenizers, hashers, self._worker_tokenize, settings.max_tracked_conversations)
        self.turns = TurnKeeper(settings.protocols, settings.reasoning_policy, settings.tenant_reasoning_policies,
                                self.prompts, settings.max_tracked_conversations)
        # Lifecycle times are shared through the session store: wall time unless the clock is virtual.
        wall = time.time if isinstance(self.clock, MonotonicClock) else self.clock.now
        self.tiers = TierKeeper(settings, self.pool, self.client, self.clock, self.metrics, wall,
                                self.turns.chain_tokens)
        self.prefills = BackgroundPrefill(settings, self.pool, self.client, self.metrics, wall)
        self.proxy = Proxy(settings, self.pool, self.policy, self.sessions, self.metrics, self.client, self.clock,
                           self.prompts, self.prefix, self.turns, self.tiers, self.prefills)
        self.metrics.registry.register(PrefixCollector(self))
        self.draining = False

    async def _worker_tokenize(self, model: str, body: dict[str, Any]) -> list[int] | None:
        """Tokens from the first healthy worker of ``model`` that answers /tokenize."""
        for w in self.pool.all():
            if w.config.model != model or not w.healthy:
                continue
            try:
                r = await self.client.post(f"{w.config.url}/tokenize", json=body, timeout=5.0)
            except httpx.HTTPError:
                continue
            if r.status_code == 200:
                toks = r.json().get("tokens")
                if isinstance(toks, list):
                    return [int(t) for t in toks]
        return None

    async def start(self) -> None:
        await self.pool.check_all()  # know who is healthy before the first request
        await self.subscriber.start()
        for model in self.pool.models():
            await self.prompts.check_parity(model)
        self.pool.start()

    async def stop(self) -> None:
        await self.prefills.aclose()
        await self.tiers.aclose()
        await self.pool.stop()
        await self.subscriber.stop()
        await self.client.aclose()
        if isinstance(self.sessions, RedisSessionStore):
            await self.sessions.close()

    def refresh_gauges(self) -> None:
        for w in self.pool.all():
            self.metrics.worker_healthy.labels(w.id).set(1 if w.healthy else 0)
            self.metrics.worker_in_flight.labels(w.id).set(w.in_flight)


def create_app(settings: GatewaySettings, clock: Clock | None = None,
               sessions: SessionStore | None = None) -> FastAPI:
    gw = Gateway(settings, clock, sessions)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await gw.start()
        try:
            yield
        finally:
            await gw.stop()

    app = FastAPI(title="kvgate", lifespan=lifespan)
    app.state.gateway = gw

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(exc.detail), type_, None, exc.status_code), status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        err = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        param = ".".join(str(p) for p in err["loc"][1:]) or None
        return JSONResponse(error_body(str(err["msg"]), "invalid_request_error", param, None), status_code=400)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await gw.proxy.handle(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await gw.proxy.handle(request, "completions")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [
            {"id": m, "object": "model", "created": 0, "owned_by": "kvgate"} for m in gw.pool.models()]}

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        per_model = gw.pool.ready()
        ok = bool(per_model) and all(per_model.values()) and not gw.draining
        return JSONResponse({"ready": ok, "draining": gw.draining, "models": per_model},
                            status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        gw.refresh_gauges()
        try:
            gw.metrics.sessions.set(await gw.sessions.count())
        except SessionStoreError:
            gw.metrics.session_store_errors.inc()
        return Response(generate_latest(gw.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/admin/policy")
    async def get_policy() -> dict[str, Any]:
        return {"policy": gw.policy.name, "cost": gw.cost.params.model_dump()}

    @app.patch("/admin/policy")
    async def patch_policy(request: Request) -> JSONResponse:
        try:
            changes = await request.json()
        except json.JSONDecodeError:
            return JSONResponse(error_body("body is not valid JSON", "invalid_request_error", None, "invalid_json"),
                                status_code=400)
        cost = changes.get("cost") if isinstance(changes, dict) else None
        if not isinstance(cost, dict):
            return JSONResponse(error_body("expected {\"cost\": {field: value}}", "invalid_request_error", "cost",
                                           "invalid_type"), status_code=400)
        try:
            # Validate the whole new parameter set, then swap it in at once: no half-applied change.
            new = CostParams.model_validate({**gw.cost.params.model_dump(), **cost})
        except ValidationError as exc:
            err = exc.errors()[0]
            return JSONResponse(error_body(f"cost.{'.'.join(str(x) for x in err['loc'])}: {err['msg']}",
                                           "invalid_request_error", f"cost.{err['loc'][0]}", "invalid_value"),
                                status_code=422)
        gw.cost.params = new
        log.info("cost model parameters changed: %s", cost)
        return JSONResponse({"policy": gw.policy.name, "cost": new.model_dump()})

    @app.get("/admin/tiers")
    async def tiers() -> dict[str, Any]:
        """Tool-wait predictions, reservations, tier adapters' state and background prefill counters."""
        return {**gw.tiers.snapshot(), "prefill": gw.prefills.snapshot()}

    @app.get("/admin/workers")
    async def workers() -> dict[str, Any]:
        return {"workers": [{"id": w.id, "url": w.config.url, "model": w.config.model, "engine": w.config.engine,
                             "healthy": w.healthy, "in_flight": w.in_flight, "running": w.running,
                             "waiting": w.waiting, "kv_usage": w.kv_usage, "reserved_tokens": w.reserved,
                             "node": w.config.node, "last_error": w.last_error}
                            for w in gw.pool.all()]}

    @app.get("/admin/conversations/{cid}/next-prefix")
    async def next_prefix(cid: str, request: Request) -> JSONResponse:
        """The canonical prefix the conversation's next request will start with (for background prefill)."""
        model = gw.turns.last_model(cid)
        if model is None:
            return JSONResponse(error_body(f"conversation `{cid}` has no completed turn", "not_found_error", "id",
                                           None), status_code=404)
        proto = gw.turns.protocol(model, "", request.query_params.get("reasoning_policy"))
        tokens = gw.turns.next_turn_prefix(model, cid, proto)
        if tokens is None:
            return JSONResponse(error_body(f"model `{model}` has no local tokenizer", "invalid_request_error", None,
                                           "no_local_tokenizer"), status_code=409)
        return JSONResponse({"conversation_id": cid, "model": model, "policy": str(proto.policy),
                             "tokens": len(tokens), "token_ids": tokens})

    @app.get("/admin/conversations/{cid:path}")
    async def conversation(cid: str) -> JSONResponse:
        try:
            s = await gw.sessions.peek(ConversationId(cid))
        except SessionStoreError as exc:
            return JSONResponse(error_body(str(exc), "service_unavailable", None, "session_store_unavailable"),
                                status_code=503)
        if s is None:
            return JSONResponse(error_body(f"conversation `{cid}` not found", "not_found_error", "id", None),
                                status_code=404)
        return JSONResponse(json.loads(json.dumps({
            "conversation_id": s.conversation_id, "id_source": s.id_source, "home_worker": s.home_worker,
            "last_activity": s.last_activity,
            "turn_count": s.turn_count, "lifecycle": s.lifecycle.to_json(),
            "turns": [{"worker": t.worker, "reason": t.reason, "prompt_tokens": t.prompt_tokens,
                       "expected_cached_tokens": t.expected_cached_tokens, "cached_tokens": t.cached_tokens,
                       "completion_tokens": t.completion_tokens, "ttft_s": t.ttft_s,
                       "lost_tokens": t.lost_tokens, "loss_cause": t.loss_cause, "loss_detail": t.loss_detail,
                       "cache_lost_tokens": t.cache_lost_tokens, "cache_loss_cause": t.cache_loss_cause}
                      for t in s.turns]})))

    return app
