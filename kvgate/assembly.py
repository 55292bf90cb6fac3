"""The gateway's composition root: builds every part once (pool, policy, stores, pipeline, observers)
and the ASGI app with its routes and fronts (HTTP, the protocol doors, gRPC and the endpoint picker)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from kvgate.admission.budgets import TenantBudgets
from kvgate.admission.capacity import model_capacity
from kvgate.admission.gate import Admission
from kvgate.admission.metrics import AdmissionCollector, SlotSyncCollector
from kvgate.admission.redis_store import RedisQuotaStore
from kvgate.admission.slotsync import SlotSync
from kvgate.admission.store import MemoryQuotaStore, QuotaStore
from kvgate.clock import Clock, MonotonicClock
from kvgate.config import GatewaySettings
from kvgate.connections import Shedding
from kvgate.discovery import make_source
from kvgate.errors import ApiError, ServiceUnavailable, error_body
from kvgate.fronts.messages.errors import error_body as messages_error
from kvgate.fronts.messages.routes import add_routes as add_messages_routes
from kvgate.fronts.responses.routes import Deps as ResponsesDeps
from kvgate.fronts.responses.routes import make_response_store, openai_error, responses_routes
from kvgate.fronts.responses.store import ResponseStore
from kvgate.gateway.actions import GatewayActions
from kvgate.gateway.admin import admin_routes
from kvgate.gateway.auth import Authenticator
from kvgate.gateway.inputlimits import PromptLimits
from kvgate.gateway.kvevents import KvEventSubscriber, SubscriberCollector
from kvgate.gateway.looplag import LoopLag, LoopLagCollector
from kvgate.gateway.membership import Membership
from kvgate.gateway.observers import MetricsObserver, RequestLogObserver, TraceObserver
from kvgate.gateway.policyedit import GatewayPolicy, PolicyLog
from kvgate.gateway.policysync import PolicySync
from kvgate.gateway.prefix import PrefixKnowledge
from kvgate.gateway.prepare import Preparer
from kvgate.gateway.prompts import PromptBuilder
from kvgate.gateway.proxy import Proxy
from kvgate.gateway.record import Recorder
from kvgate.gateway.relay import Relay
from kvgate.gateway.requestlog import RequestLog
from kvgate.gateway.route import Router
from kvgate.gateway.routedsync import RoutedSync
from kvgate.gateway.runtime import SessionRuntime
from kvgate.gateway.send import Sender
from kvgate.gateway.telemetry import GatewayMetrics, PrefixCollector
from kvgate.gateway.tierview import TierView
from kvgate.gateway.tracing import Tracing
from kvgate.gateway.turns import TurnService
from kvgate.gateway.upstream import make_upstream
from kvgate.gateway.workers import PoolCollector, WorkerPool
from kvgate.grpc.server import start_grpc
from kvgate.kvstore.capacity import RedisSlotBoard
from kvgate.kvstore.conversations import ConversationStore, MemoryConversationStore
from kvgate.kvstore.corrupt import Corruption
from kvgate.kvstore.fleet import FleetStore, MemoryFleet
from kvgate.kvstore.grouping import GroupingIndex, MemoryGroupingIndex, RedisGroupingIndex
from kvgate.kvstore.health import HealthBoard, RedisHealthBoard
from kvgate.kvstore.policy import MemoryPolicyStore, PolicyStore, RedisPolicyStore
from kvgate.kvstore.redis_conversations import RedisConversationStore
from kvgate.kvstore.redis_fleet import RedisFleet
from kvgate.kvstore.routed import RedisRoutedRecord
from kvgate.router.cost import CostModel
from kvgate.router.policies import Policy, PolicyParams, make_policy
from kvgate.router.types import WorkerId
from kvgate.session.controller import ControllerParams, SessionController
from kvgate.session.conversation import Limits
from kvgate.session.state import Learned
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


def make_stores(settings: GatewaySettings, clock: Clock) -> tuple[ConversationStore, FleetStore]:
    if settings.session_store == "redis":
        return (RedisConversationStore(settings.redis_url, settings.session_ttl_s, settings.redis_prefix,
                                       cluster=settings.redis_cluster),
                RedisFleet(settings.redis_url, settings.redis_prefix, cluster=settings.redis_cluster))
    return (MemoryConversationStore(clock, settings.session_ttl_s, settings.max_sessions, settings.max_store_bytes),
            MemoryFleet())


def make_health_board(settings: GatewaySettings) -> HealthBoard | None:
    """Where replicas tell each other of the workers they ejected (kvstore/health.py): their shared Redis."""
    if settings.session_store != "redis":
        return None
    return RedisHealthBoard(settings.redis_url, settings.redis_prefix, 10 * settings.health_interval_s + 60,
                            cluster=settings.redis_cluster)


def make_routed_sync(settings: GatewaySettings, pool: WorkerPool, prefix: PrefixKnowledge, clock: Clock,
                     wall: Callable[[], float]) -> RoutedSync | None:
    """The fleet's record of what each replica routed to workers without events: their shared Redis."""
    if settings.session_store != "redis" or settings.routed_record_poll_s <= 0:
        return None
    record = RedisRoutedRecord(settings.redis_url, settings.redis_prefix, settings.approx_ttl_s,
                               cluster=settings.redis_cluster)

    def blocks(wid: WorkerId) -> int:
        spec = pool.spec(wid)
        return pool.capacity_tokens(wid) // spec.block_size if spec is not None else 0

    return RoutedSync(record, prefix, lambda: [w.id for w in pool.all()], blocks, clock.now, wall,
                      settings.routed_record_poll_s)


def make_slot_sync(settings: GatewaySettings, pool: WorkerPool, clock: Clock, wall: Callable[[], float],
                   corruption: Corruption) -> SlotSync | None:
    """The engines' learned caps shared through the replicas' Redis, read before serving."""
    if settings.session_store != "redis" or settings.admission.slot_share_ttl_s <= 0:
        return None
    board = RedisSlotBoard(settings.redis_url, settings.redis_prefix, settings.admission.slot_share_ttl_s,
                           corruption, cluster=settings.redis_cluster)
    return SlotSync(board, pool.all, clock.now, wall, pool.replica, settings.health_interval_s)


def make_policy_store(settings: GatewaySettings) -> PolicyStore:
    """Where policy edits are versioned: the replicas' shared Redis, or this process alone."""
    if settings.session_store == "redis":
        return RedisPolicyStore(settings.redis_url, settings.redis_prefix, cluster=settings.redis_cluster)
    return MemoryPolicyStore()


def make_grouping(settings: GatewaySettings) -> GroupingIndex | None:
    """Where keyless conversations are found again after a compaction (session/regroup.py)."""
    if not settings.regroup_derived:
        return None
    if settings.session_store == "redis":
        return RedisGroupingIndex(settings.redis_url, settings.session_ttl_s, settings.redis_prefix,
                                  cluster=settings.redis_cluster)
    return MemoryGroupingIndex(settings.max_store_bytes // 16)


def make_admission(settings: GatewaySettings, pool: WorkerPool) -> Admission | None:
    a = settings.admission
    if not a.enabled:
        return None
    shared = a.store == "redis" or (a.store == "auto" and settings.session_store == "redis")
    store: QuotaStore = RedisQuotaStore(settings.redis_url, settings.redis_prefix, cluster=settings.redis_cluster) \
        if shared else MemoryQuotaStore()

    def capacity(model: str) -> int | None:
        caps = [w.free_slots() for w in pool.all() if w.config.model == model and w.healthy]
        return model_capacity(caps) if caps else None  # no healthy worker: the sender answers that at once

    return Admission(a, store, capacity, settings.retry_after_s)


class Gateway:
    """Everything one gateway process owns; created per app, so tests can run several side by side."""

    def __init__(self, settings: GatewaySettings, clock: Clock | None = None,
                 stores: tuple[ConversationStore, FleetStore] | None = None, tracing: Tracing | None = None) -> None:
        self.settings = settings
        self.tracing = tracing or Tracing.from_env()  # OTEL_* variables; off unless they name an exporter
        self.clock = clock or MonotonicClock()
        # Times stored in shared records (lifecycle, reservations, residency): wall time unless virtual.
        wall = time.time if isinstance(self.clock, MonotonicClock) else self.clock.now
        self.metrics = m = GatewayMetrics(settings.tokenizers)  # model directories give KV bytes per token
        timeout = httpx.Timeout(connect=settings.upstream_connect_timeout_s, read=settings.upstream_read_timeout_s,
                                write=30.0, pool=settings.upstream_connect_timeout_s)
        self.client = make_client(timeout)
        self.auth = Authenticator(settings.auth, self.client)
        self.pool = WorkerPool(settings.workers, self.client, self.clock, settings.health_interval_s,
                               settings.health_timeout_s, settings.hash_seed, settings.eject_after_failures,
                               settings.admission.worker_slots)
        self.loop_lag = LoopLag()
        self._lag_task: asyncio.Task[None] | None = None
        self.pool.blames_loop = self.loop_lag.blames_loop
        self.pool.board = make_health_board(settings)
        self.pool.connect_timeout_s = settings.upstream_connect_timeout_s
        self.policy: Policy = make_policy(settings.policy, PolicyParams(settings.affinity_epsilon, settings.cost))
        # The cost model prices background prefills and tier loads whatever the routing policy; when it
        # routes too, it is the same object, so PATCH /admin/policy changes both at once.
        self.cost = self.policy if isinstance(self.policy, CostModel) else CostModel(settings.cost.model_copy())
        self.policy_log = PolicyLog()
        self.store, self.fleet = stores or make_stores(settings, self.clock)
        self.prefix = PrefixKnowledge(self.pool.spec, self.pool.specs, settings.approx_ttl_s,
                                      settings.inflight_ttl_s, self.pool.capacity_tokens)
        self.routed_sync = make_routed_sync(settings, self.pool, self.prefix, self.clock, wall)
        self.slot_sync = make_slot_sync(settings, self.pool, self.clock, wall, self.store.corruption)
        self.subscriber = KvEventSubscriber(self.prefix.events, settings.workers, self.client,
                                            warm_start=settings.kv_events_warm_start)
        # A worker that restarted (or is back after being out) is expected to hold nothing until its
        # events are replayed again.
        self.pool.on_restart(self.prefix.worker_restarted)
        self.pool.on_restart(self.subscriber.request_resync)
        tokenizers = {mod: ChatTokenizer(Path(d), settings.template_sandbox) for mod, d in settings.tokenizers.items()}
        self.prompts = PromptBuilder(tokenizers, self.pool.specs, self._worker_tokenize,
                                     settings.hostile.inline_prompt_chars)
        self.prompt_limits = PromptLimits(settings.hostile, {m: t.max_token_chars for m, t in tokenizers.items()},
                                          {m: t.max_model_len for m, t in tokenizers.items()})
        self.pool.on_context(self.prompt_limits.learn)  # each worker's, as it first answers (gateway/workers.py)
        self.turns = TurnService(settings.protocols, settings.reasoning_policy, settings.tenant_reasoning_policies,
                                 self.prompts, Limits(max_bytes=settings.max_conversation_bytes))
        self.tiers = TierView(settings, self.client, self.clock.now, wall, m, self.cost)
        self.admission = make_admission(settings, self.pool)  # before the runtime: the budgets share its store
        budgets = None if self.admission is None else \
            TenantBudgets(self.admission.settings, self.admission.store, self.fleet)
        actions = GatewayActions(settings, self.pool, self.tiers, self.turns, self.client, self.cost)
        self.runtime = SessionRuntime(SessionController(ControllerParams(
            settings.prefill, max_retain_s=settings.cache_control_max_retain_s)),
                                      Learned(settings.waits, settings.prefill), self.store, self.fleet, actions, m,
                                      wall, tick_s=settings.timer_tick_s, lease_s=settings.timer_lease_s,
                                      tracing=self.tracing, budgets=budgets)
        self.policy_target = GatewayPolicy(self.cost, self.runtime, self.tiers)
        self.policy_sync = PolicySync(make_policy_store(settings), self.policy_target, self.policy_log)
        self.grouping = make_grouping(settings)
        self.recorder = recorder = Recorder(self.runtime, self.turns, self.tiers, m, self.policy.name, self.grouping)
        self.requests = RequestLog(settings.request_log, settings.request_log_max_bytes, settings.request_log_backups,
                                   bytes.fromhex(settings.request_log_key) if settings.request_log_key else None)
        # What is observed of every exchange, for every front (gateway/observers.py).
        observers = [MetricsObserver(m), TraceObserver(), RequestLogObserver(self.requests)]
        self.router = router = Router(self.pool, self.policy, self.prefix, self.tiers, self.clock, m, observers)
        self.upstream = make_upstream(settings.upstream_client, self.client, settings.upstream_connect_timeout_s,
                                      settings.upstream_read_timeout_s, settings.upstream_keepalive_s)
        # The endpoint picker (kvgate/epp) relays and records responses Envoy forwards with the same objects.
        self.relay = Relay(self.pool, self.clock, m, recorder, self.policy.name, self.requests, router,
                           observers)
        sender = Sender(settings, router, self.upstream, self.clock, m, self.relay)
        if self.admission is not None:
            m.registry.register(AdmissionCollector(self.admission))
        self.proxy = Proxy(Preparer(settings, self.pool, self.turns, self.prompts, self.runtime, m, router.holder,
                                    self.prompt_limits, self.admission, self.grouping),
                           sender, m, self.tracing, self.auth, self._shed)
        self.membership = None if settings.discovery is None else Membership(
            self.pool, self.subscriber, self.prefix, make_source(settings.discovery),
            settings.kv_events_sync_timeout_s, self.prompts.check_parity, settings.health_interval_s)
        self._register_collectors()
        self.draining = False

    def _register_collectors(self) -> None:
        """What /metrics reads from the parts' own state at each scrape."""
        r = self.metrics.registry
        r.register(PrefixCollector(
            self.prefix.events.stats, {"precise": self.prefix.index, "approximate": self.prefix.approx.index},
            lambda: self.prompts.parity_failures))
        r.register(PoolCollector(self.pool))
        r.register(LoopLagCollector(self.loop_lag))
        if self.slot_sync is not None:
            r.register(SlotSyncCollector(self.slot_sync))
        r.register(SubscriberCollector(self.subscriber))

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

    def _shed(self) -> bool:
        lag_ms = self.settings.overload_shed_lag_ms
        return lag_ms is not None and self.loop_lag.overloaded(lag_ms / 1000)

    def shedding(self) -> Shedding | None:
        """The same refusal as ``Proxy.handle``'s, made at the connection before the app runs (None: off)."""
        if self.settings.overload_shed_lag_ms is None:
            return None
        exc = ServiceUnavailable("kvgate is overloaded; retry later.", code="overloaded")
        openai = bytes(exc.response().body)
        answers = {b"/v1/chat/completions": openai, b"/v1/completions": openai,
                   b"/v1/responses": bytes(JSONResponse(openai_error(503, exc)).body),
                   b"/v1/messages": bytes(JSONResponse(messages_error(503, exc)).body)}

        def active() -> bool:
            if not self._shed():
                return False
            self.metrics.shed.inc()
            return True
        return Shedding(active, answers, self.settings.retry_after_s)

    async def start(self) -> None:
        self._lag_task = asyncio.create_task(self.loop_lag.run(), name="kvgate-loop-lag")
        await self.auth.start()
        await self.pool.check_all()  # know who is healthy before the first request
        with contextlib.suppress(Exception):  # and who the fleet ejected (advice: never a reason not to start)
            await self.pool.learn()
        await self.tiers.start()  # a coordinator of another LMCache API stops the start here
        await self.subscriber.start()
        await self.subscriber.wait_synced(self.settings.kv_events_sync_timeout_s)
        for model in self.pool.models():
            await self.prompts.check_parity(model)
        if self.membership is not None:
            await self.membership.start(first_timeout_s=10.0)
        await self.policy_sync.start()  # the fleet's parameters before the first request
        if self.routed_sync is not None:
            self.pool.on_restart(self.routed_sync.worker_restarted)
            await self.routed_sync.start()  # and the fleet's routes
        if self.slot_sync is not None:
            await self.slot_sync.start()  # and the engines' caps, so the first admissions do not over-admit
        self.pool.start()
        self.runtime.start()
        if self.admission is not None:
            self.admission.start()
        self.requests.start(self.log_header())

    def log_header(self) -> dict[str, Any]:
        """What ``kvgate tune`` needs to replay this gateway's traffic: its settings and its workers."""
        s = self.settings
        return {"policy": s.policy, "cost": self.cost.params.model_dump(), "waits": s.waits.model_dump(),
                "prefill": s.prefill.model_dump(), "reasoning_policy": s.reasoning_policy,
                "cpu_tier_ttl_s": s.cpu_tier_ttl_s, "tiers": s.tier_redis_url is not None,
                "workers": [{"id": w.id, "model": w.config.model, "engine": w.config.engine,
                             "block_size": w.learned_block_size or w.config.block_size, "node": w.config.node,
                             "kv_capacity_tokens": w.config.kv_capacity_tokens or w.kv_capacity,
                             "kv_events": w.config.kv_events is not None} for w in self.pool.all()]}

    async def stop(self) -> None:
        if self._lag_task is not None:
            self._lag_task.cancel()
        await self.auth.stop()
        if self.admission is not None:
            await self.admission.aclose()
        await self.policy_sync.stop()
        await self.policy_sync.store.close()
        if self.routed_sync is not None:
            await self.routed_sync.stop()
        if self.slot_sync is not None:
            await self.slot_sync.stop()
        await self.runtime.aclose()
        await asyncio.to_thread(self.requests.close)
        await self.tiers.aclose()
        if self.membership is not None:
            await self.membership.stop()
        await self.pool.stop()
        if self.pool.board is not None:
            await self.pool.board.close()
        await self.subscriber.stop()
        await self.upstream.aclose()
        await self.client.aclose()
        await self.store.close()
        await self.fleet.close()
        if self.grouping is not None:
            await self.grouping.close()
        self.tracing.shutdown()

    def refresh_gauges(self) -> None:
        for w in self.pool.all():
            self.metrics.worker_healthy.labels(w.id).set(1 if w.healthy else 0)
            self.metrics.worker_in_flight.labels(w.id).set(w.in_flight)


def create_app(settings: GatewaySettings, clock: Clock | None = None,
               stores: tuple[ConversationStore, FleetStore] | None = None, tracing: Tracing | None = None) -> FastAPI:
    gw = Gateway(settings, clock, stores, tracing)
    # OpenAI Responses (kvgate/fronts/responses): over the chat pipeline, with its retrievable responses.
    responses = make_response_store(settings, gw.clock)
    app = FastAPI(title="kvgate", lifespan=make_lifespan(gw, responses))
    app.state.gateway = gw
    add_error_handlers(app)
    add_inference_routes(app, gw)
    add_probe_routes(app, gw)
    app.include_router(responses_routes(gw.proxy, gw.auth, settings, ResponsesDeps(gw.store, responses)))
    app.include_router(admin_routes(gw))
    return app


def make_lifespan(gw: Gateway, responses: ResponseStore) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await gw.start()
        # gRPC (kvgate/grpc/server.py): the control API and the endpoint picker, each only when its port is set.
        grpc_servers = await start_grpc(gw)
        app.state.grpc = grpc_servers
        try:
            yield
        finally:
            await grpc_servers.stop(gw.settings.drain_timeout_s)
            await gw.stop()
            await responses.close()

    return lifespan


def add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(exc.detail), type_, None, exc.status_code), status_code=exc.status_code)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        # Any route answers kvgate's own errors as such: the admin routes' 401/403 (kvgate/gateway/auth.py),
        # their bodies' 400/413 (read_json).
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        err = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        param = ".".join(str(p) for p in err["loc"][1:]) or None
        return JSONResponse(error_body(str(err["msg"]), "invalid_request_error", param, None), status_code=400)

    @app.exception_handler(ClientDisconnect)
    async def client_gone(request: Request, exc: ClientDisconnect) -> Response:
        # An admin request whose client left while its body was arriving: nobody reads the answer, and it
        # is not the gateway's failure (the 499 of nginx and of the proxy's own requests).
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        # Client input is answered before it gets here (prepare.py, proxy.py); what remains is kvgate's
        # own failure, still in OpenAI's shape so clients parse it.
        log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        return JSONResponse(error_body("Internal error in the gateway.", "internal_error", None, None),
                            status_code=500)


def add_inference_routes(app: FastAPI, gw: Gateway) -> None:
    """The OpenAI and Anthropic doors over the proxy (the Responses door is a router of its own)."""

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await gw.proxy.handle(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await gw.proxy.handle(request, "completions")

    add_messages_routes(app, gw)  # /v1/messages, /v1/messages/count_tokens (kvgate/fronts/messages)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [
            {"id": m, "object": "model", "created": 0, "owned_by": "kvgate"} for m in gw.pool.models()]}


def add_probe_routes(app: FastAPI, gw: Gateway) -> None:
    """What load balancers and Prometheus poll: liveness, readiness, metrics."""

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
        # Nothing here may cost more than the registry: no session store call (a Redis SCAN per scrape
        # grew with the sessions); active conversations come from a fixed-size sketch kept on the way.
        gw.refresh_gauges()
        return Response(generate_latest(gw.metrics.registry), media_type=CONTENT_TYPE_LATEST)
