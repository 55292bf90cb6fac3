"""The gateway's ASGI app: wiring of pool, policy, session store and proxy behind the HTTP routes."""

from __future__ import annotations

import json
import logging
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvgate.clock import Clock, MonotonicClock
from kvgate.config import GatewaySettings
from kvgate.errors import error_body
from kvgate.gateway.proxy import Proxy
from kvgate.gateway.telemetry import GatewayMetrics
from kvgate.gateway.workers import WorkerPool
from kvgate.kvstore.sessions import MemorySessionStore, SessionStore
from kvgate.router.policies import make_policy
from kvgate.router.types import ConversationId

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
        params = {"epsilon": settings.affinity_epsilon} if settings.policy == "session_affinity" else {}
        self.policy = make_policy(settings.policy, **params)
        self.sessions = sessions or MemorySessionStore(self.clock, settings.session_ttl_s, settings.max_sessions)
        self.proxy = Proxy(settings, self.pool, self.policy, self.sessions, self.metrics, self.client, self.clock)
        self.draining = False

    async def start(self) -> None:
        await self.pool.check_all()  # know who is healthy before the first request
        self.pool.start()

    async def stop(self) -> None:
        await self.pool.stop()
        await self.client.aclose()

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
        gw.metrics.sessions.set(await gw.sessions.count())
        return Response(generate_latest(gw.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/admin/workers")
    async def workers() -> dict[str, Any]:
        return {"workers": [{"id": w.id, "url": w.config.url, "model": w.config.model, "engine": w.config.engine,
                             "healthy": w.healthy, "in_flight": w.in_flight, "running": w.running,
                             "waiting": w.waiting, "kv_usage": w.kv_usage, "last_error": w.last_error}
                            for w in gw.pool.all()]}

    @app.get("/admin/conversations/{cid:path}")
    async def conversation(cid: str) -> JSONResponse:
        s = await gw.sessions.peek(ConversationId(cid))
        if s is None:
            return JSONResponse(error_body(f"conversation `{cid}` not found", "not_found_error", "id", None),
                                status_code=404)
        return JSONResponse(json.loads(json.dumps({
            "conversation_id": s.conversation_id, "id_source": s.id_source, "home_worker": s.home_worker,
            "last_activity": s.last_activity,
            "turns": [{"worker": t.worker, "reason": t.reason, "prompt_tokens": t.prompt_tokens,
                       "cached_tokens": t.cached_tokens, "completion_tokens": t.completion_tokens,
                       "ttft_s": t.ttft_s} for t in s.turns]})))

    return app
