"""Forwarding one request: identify the conversation, route, send, retry, relay, record.

A worker that fails before kvgate has sent the client anything (connection refused, reset, timeout,
5xx, or a stream that dies before its first event) is marked unhealthy and the request goes to
another worker, up to ``max_attempts`` workers. After the first byte a failure ends the stream with
an SSE error event. A client that disconnects closes the upstream request, which makes vLLM abort it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import httpx
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from kvgate.clock import Clock
from kvgate.config import GatewaySettings
from kvgate.errors import ApiError, BadRequest, Conflict, NotFound, PayloadTooLarge, ServiceUnavailable
from kvgate.gateway import identity
from kvgate.gateway.background_prefill import BackgroundPrefill
from kvgate.gateway.history import Canonical
from kvgate.gateway.lifecycle import Lifecycle, State
from kvgate.gateway.loss import PromptLoss, explain_cache
from kvgate.gateway.prefix import PrefixKnowledge
from kvgate.gateway.prompts import Prompt, PromptBuilder
from kvgate.gateway.protocols import ModelProtocol
from kvgate.gateway.requests import KVGATE_FIELDS, validate_chat, validate_completion
from kvgate.gateway.sse import SseEvent, SseSplitter, error_event
from kvgate.gateway.telemetry import GatewayMetrics
from kvgate.gateway.tiering import TierKeeper
from kvgate.gateway.turns import HistoryConflict, Reply, TurnKeeper, UnknownResponse
from kvgate.gateway.workers import WorkerPool
from kvgate.kvstore.redis_sessions import SessionStoreError
from kvgate.kvstore.sessions import Session, SessionStore, TurnRecord
from kvgate.router.policies import Policy
from kvgate.router.types import ConversationId, Decision, RouteRequest, WorkerId

log = logging.getLogger(__name__)

Endpoint = Literal["chat", "completions"]
_PATHS: dict[Endpoint, str] = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
_FORWARD_HEADERS = ("authorization", "x-request-id", "traceparent", "tracestate")
T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected while kvgate was waiting on the worker."""


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    @classmethod
    def parse(cls, obj: Any) -> Usage | None:
        if not isinstance(obj, dict):
            return None
        details = obj.get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens") if isinstance(details, dict) else 0
        return cls(int(obj.get("prompt_tokens") or 0), int(obj.get("completion_tokens") or 0), int(cached or 0))


@dataclass(slots=True)
class _Ctx:
    """One request in flight: what is needed to record its outcome."""

    endpoint: Endpoint
    model: str
    ident: identity.Identity
    session: Session | None
    decision: Decision
    started: float
    prompt: Prompt
    ttft_s: float | None = None
    usage: Usage | None = None
    turn: _Turn | None = None
    """Chat only: the canonical history sent, its policy, the loss explanation."""
    reply: Reply = field(default_factory=Reply)
    chosen_matched_tokens: int = 0
    best_matched_tokens: int = 0
    response_id: str | None = None
    life: Lifecycle = field(default_factory=Lifecycle)
    """The session's lifecycle with this request applied (written when the turn is recorded)."""

    @property
    def prefill_tokens(self) -> int:
        return max(1, self.prompt.length - self.decision.expected_cached_tokens)


@dataclass(slots=True)
class _Turn:
    canonical: Canonical
    policy: str
    protocol: ModelProtocol
    loss: PromptLoss | None = None
    tools: Any = None


class Proxy:
    def __init__(self, settings: GatewaySettings, pool: WorkerPool, policy: Policy, sessions: SessionStore,
                 metrics: GatewayMetrics, client: httpx.AsyncClient, clock: Clock, prompts: PromptBuilder,
                 prefix: PrefixKnowledge, turns: TurnKeeper, tiers: TierKeeper,
                 prefills: BackgroundPrefill) -> None:
        self.settings = settings
        self.pool = pool
        self.policy = policy
        self.sessions = sessions
        self.metrics = metrics
        self.client = client
        self.clock = clock
        self.prompts = prompts
        self.prefix = prefix
        self.turns = turns
        self.tiers = tiers
        self.prefills = prefills
        self._background: set[asyncio.Task[None]] = set()

    # -- entry ---------------------------------------------------------------------------------
    async def handle(self, request: Request, endpoint: Endpoint) -> Response:
        try:
            resp = await self._handle(request, endpoint)
        except ApiError as exc:
            resp = exc.response()
        except ClientGone:
            self.metrics.client_disconnects.inc()
            resp = Response(status_code=499)
        self.metrics.requests.labels(endpoint, str(resp.status_code)).inc()
        return resp

    async def _handle(self, request: Request, endpoint: Endpoint) -> Response:
        body = await self._read_json(request)
        (validate_chat if endpoint == "chat" else validate_completion)(body)
        model = body["model"]
        if not self.pool.serves(model):
            raise NotFound(f"The model `{model}` does not exist.", param="model", code="model_not_found")
        try:
            ident = identity.resolve(request.headers, body, self.settings.conversation_headers,
                                     self.settings.tenant_header)
        except identity.BadIdentity as exc:
            raise BadRequest(str(exc), param=exc.param, code="invalid_conversation_id") from exc
        self.metrics.conversation_source.labels(ident.source.split(":")[0]).inc()
        turn: _Turn | None = None
        if endpoint == "chat" and body.get("previous_response_id"):
            # Stateful continuation: the client sends only what is new; kvgate holds the rest.
            try:
                cid = self.turns.conversation_of(body["previous_response_id"])
                full = self.turns.continue_from(cid, body["messages"])
            except UnknownResponse as exc:
                raise NotFound(str(exc), param="previous_response_id", code="response_not_found") from exc
            except HistoryConflict as exc:
                raise Conflict(str(exc), param=f"messages[{exc.index}]", code="history_conflict") from exc
            ident = identity.Identity(ConversationId(cid), "previous_response_id", ident.tenant)
            body = {**body, "messages": full}
        try:
            session = await self.sessions.get(ident.conversation_id)
        except SessionStoreError as exc:
            # The store is down: route without the conversation's history rather than fail.
            self.metrics.session_store_errors.inc()
            log.warning("session store: %s", exc)
            session = None
        if endpoint == "chat":
            # The history the engine sees: exact replies restored, completed turns canonical.
            requested = body.get("reasoning_policy") or request.headers.get("x-kvgate-reasoning-policy")
            protocol = self.turns.protocol(model, ident.tenant, requested)
            canonical = self.turns.canonical(protocol, body["messages"], ident.conversation_id, model)
            body = {**body, "messages": canonical.messages}
            turn = _Turn(canonical, str(protocol.policy), protocol, tools=body.get("tools"))
        prompt = await self.prompts.prepare(model, endpoint, body, ident.conversation_id)
        self.metrics.prompt_source.labels(prompt.source).inc()
        if turn is not None:
            turn.loss = self.turns.explain(ident.conversation_id, prompt.tokens, self.prefix.block_size(model),
                                           turn.canonical)
            for r in turn.canonical.restored:
                self.metrics.restored.labels(r.field.split(":")[0]).inc()
        fwd = {k: v for k, v in body.items() if k not in KVGATE_FIELDS}
        stream = bool(body.get("stream"))
        hide_usage = False
        if stream:
            opts = body.get("stream_options") or {}
            if not opts.get("include_usage"):
                # kvgate needs usage for every response; the client did not ask, so keep it out of its stream.
                fwd["stream_options"] = {**opts, "include_usage": True}
                hide_usage = True
        headers = {k: v for k, v in request.headers.items() if k in _FORWARD_HEADERS}
        payload = json.dumps(fwd).encode()
        msgs = body.get("messages") if endpoint == "chat" else None
        user_turn = isinstance(msgs, list) and bool(msgs) and isinstance(msgs[-1], dict) \
            and msgs[-1].get("role") == "user"
        before = session.lifecycle if session else Lifecycle()
        life = self.tiers.arrived(ident.conversation_id, ident.tenant, before)
        force = self.prefills.arrived(ident.conversation_id, ident.tenant,
                                      user_turn and before.state is State.AWAITING_USER)
        return await self._route_and_send(request, endpoint, model, ident, session, prompt, payload, headers,
                                          stream, hide_usage, turn, life, force)

    async def _read_json(self, request: Request) -> dict[str, Any]:
        limit = self.settings.max_body_bytes
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > limit:
            raise PayloadTooLarge(f"Request body of {declared} bytes exceeds the limit of {limit} bytes.",
                                  code="request_too_large")
        buf = bytearray()
        async for chunk in request.stream():
            buf += chunk
            if len(buf) > limit:
                raise PayloadTooLarge(f"Request body exceeds the limit of {limit} bytes.", code="request_too_large")
        try:
            body = json.loads(bytes(buf))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise BadRequest(f"Request body is not valid JSON: {exc}", code="invalid_json") from exc
        if not isinstance(body, dict):
            raise BadRequest("Request body must be a JSON object.", code="invalid_json")
        return body

    # -- routing and retries -------------------------------------------------------------------
    async def _route_and_send(self, request: Request, endpoint: Endpoint, model: str, ident: identity.Identity,
                              session: Session | None, prompt: Prompt, payload: bytes, headers: dict[str, str],
                              stream: bool, hide_usage: bool, turn: _Turn | None = None,
                              life: Lifecycle | None = None, force: WorkerId | None = None) -> Response:
        tried: set[WorkerId] = set()
        last_error = ""
        fleet = self.pool.snapshot(model)
        matched = self.prefix.match(model, prompt.hashes, [w.id for w in fleet.workers], self.clock.now())
        bs = self.prefix.block_size(model)
        cpu, remote = await self.tiers.tier_tokens(model, ident.conversation_id, prompt.tokens,
                                                   max(matched.values(), default=0) * bs)
        for attempt in range(self.settings.max_attempts):
            rreq = RouteRequest(model=model, conversation_id=ident.conversation_id,
                                home_worker=session.home_worker if session else None, exclude=frozenset(tried),
                                prompt_tokens=prompt.length, matched_blocks=matched, block_size=bs,
                                cpu_tokens=cpu, remote_tokens=remote)
            forced = fleet.get(force) if force is not None and force not in tried else None
            if forced is not None and forced.healthy:
                # A background prefill of this prompt's prefix runs there: follow it.
                limit = max(0, (prompt.length - 1) // bs) * bs  # vLLM recomputes the last token
                decision: Decision | None = Decision(forced.id, "prefill_pending",
                                                     min(matched.get(forced.id, 0) * bs, limit))
            else:
                decision = self.policy.pick(rreq, self.pool.snapshot(model))
            if decision is None:
                break
            if attempt > 0:
                self.metrics.retries.inc()
            self.metrics.route_decisions.labels(self.policy.name, decision.reason).inc()
            wid = decision.worker
            tried.add(wid)
            ctx = _Ctx(endpoint, model, ident, session, decision, self.clock.now(), prompt)
            if life is not None:
                ctx.life = life
            ctx.chosen_matched_tokens = matched.get(wid, 0) * bs
            ctx.best_matched_tokens = max(matched.values(), default=0) * bs
            ctx.turn = turn
            worker = self.pool.get(wid)
            self.pool.acquire(wid, ctx.prefill_tokens)
            released = False
            try:
                upstream = await self._until_disconnect(request, self.client.send(
                    self.client.build_request("POST", worker.config.url + _PATHS[endpoint], content=payload,
                                              headers={**headers, "content-type": "application/json"}),
                    stream=True))
                if upstream.status_code >= 500:
                    text = (await upstream.aread())[:200].decode(errors="replace")
                    await upstream.aclose()
                    if upstream.status_code in (502, 503, 504):
                        self._failed(wid, f"HTTP {upstream.status_code}: {text}", "status_5xx")
                    else:
                        # A 500 may be this request's fault: try elsewhere, but do not take the worker
                        # out of the fleet (a repeated bad request would otherwise empty it).
                        self.metrics.upstream_failures.labels(wid, "status_500").inc()
                    last_error = f"worker {wid} answered {upstream.status_code}"
                    continue
                if upstream.status_code >= 400:
                    # The worker judged the request; its answer goes back unchanged.
                    content = await upstream.aread()
                    await upstream.aclose()
                    return Response(content, status_code=upstream.status_code,
                                    media_type=upstream.headers.get("content-type"), headers=self._headers(ctx))
                # The worker accepted the request: kvgate's view of its cache now includes this prompt.
                self.prefix.routed(model, wid, prompt.hashes, self.clock.now())
                self.tiers.routed(ident.conversation_id, wid, prompt.length)
                if stream:
                    it = upstream.aiter_raw()
                    try:
                        first = await self._until_disconnect(request, _anext(it))
                    except StopAsyncIteration:
                        first = b""
                    except ClientGone:
                        await upstream.aclose()  # the worker sees the disconnect and aborts
                        raise
                    except httpx.HTTPError as exc:
                        await upstream.aclose()
                        self._failed(wid, repr(exc), "stream_before_first_byte")
                        last_error = f"worker {wid} failed before the first byte"
                        continue
                    released = True  # the relay owns the worker slot from here
                    return StreamingResponse(self._relay(ctx, upstream, first, it, hide_usage),
                                             status_code=upstream.status_code, media_type="text/event-stream",
                                             headers=self._headers(ctx))
                try:
                    content = await self._until_disconnect(request, upstream.aread())
                finally:
                    await upstream.aclose()
                obj = _loads(content)
                ctx.usage = Usage.parse(obj.get("usage")) if obj else None
                ctx.response_id = obj.get("id") if obj and isinstance(obj.get("id"), str) else None
                choices = obj.get("choices") if obj else None
                if isinstance(choices, list) and choices and isinstance(choices[0], dict) \
                        and isinstance(choices[0].get("message"), dict):
                    ctx.reply.set_message(choices[0]["message"])
                ctx.ttft_s = None
                # The worker is done with it: release first, so what the turn's end decides (a background
                # prefill) sees the queue without this request.
                released = True
                self.pool.release(wid, ctx.prefill_tokens)
                await self._record(ctx)
                return Response(content, status_code=upstream.status_code,
                                media_type=upstream.headers.get("content-type", "application/json"),
                                headers=self._headers(ctx))
            except httpx.HTTPError as exc:
                self._failed(wid, repr(exc), type(exc).__name__)
                last_error = f"worker {wid}: {type(exc).__name__}"
                continue
            finally:
                if not released:
                    self.pool.release(wid, ctx.prefill_tokens)
        if not tried:
            raise ServiceUnavailable(f"No healthy worker for model `{model}`.", code="no_healthy_worker",
                                     headers={"Retry-After": str(self.settings.retry_after_s)})
        raise ServiceUnavailable(f"All {len(tried)} attempted workers failed; last: {last_error}",
                                 code="upstream_failed", headers={"Retry-After": str(self.settings.retry_after_s)})

    def _failed(self, wid: WorkerId, error: str, kind: str) -> None:
        self.metrics.upstream_failures.labels(wid, kind).inc()
        self.pool.mark_failed(wid, error)

    def _headers(self, ctx: _Ctx) -> dict[str, str]:
        return {
            "x-kvgate-worker": ctx.decision.worker,
            "x-kvgate-route-reason": f"{self.policy.name}:{ctx.decision.reason}",
            "x-kvgate-conversation-id": ctx.ident.conversation_id,
            "x-kvgate-conversation-source": ctx.ident.source,
            "x-kvgate-expected-cached-tokens": str(ctx.decision.expected_cached_tokens),
            **self._history_headers(ctx),
        }

    def _history_headers(self, ctx: _Ctx) -> dict[str, str]:
        turn = ctx.turn
        if turn is None:
            return {}
        out = {"x-kvgate-history": f"policy={turn.policy}; restored={len(turn.canonical.restored)}; "
                                   f"reasoning_changed={len(turn.canonical.reasoning_changed)}"}
        if turn.loss is not None:
            out["x-kvgate-prefix-reuse"] = (f"cached={ctx.decision.expected_cached_tokens}; expected={turn.loss.best}; "
                                            f"lost={turn.loss.lost}; cause={turn.loss.cause or 'none'}")
        return out

    async def _until_disconnect(self, request: Request, aw: Awaitable[T]) -> T:
        """Await ``aw``, but give up (raising ClientGone) if the client disconnects first."""
        task = asyncio.ensure_future(aw)
        watcher = asyncio.ensure_future(_wait_disconnect(request))
        try:
            done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if task in done:
                return task.result()
            raise ClientGone()
        finally:
            watcher.cancel()
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
                # A response that arrived while cancelling must still be closed.
                if not task.cancelled() and task.exception() is None:
                    res = task.result()
                    if isinstance(res, httpx.Response):
                        await res.aclose()

    # -- streaming relay -----------------------------------------------------------------------
    async def _relay(self, ctx: _Ctx, upstream: httpx.Response, first: bytes, it: AsyncIterator[bytes],
                     hide_usage: bool) -> AsyncIterator[bytes]:
        splitter = SseSplitter()
        outcome = "cancelled"  # until the stream ends or breaks: the client went away
        try:
            chunk: bytes | None = first
            while chunk is not None:
                for ev in splitter.feed(chunk):
                    out = self._inspect(ctx, ev, hide_usage)
                    if out is not None:
                        yield out
                try:
                    chunk = await _anext(it)
                except StopAsyncIteration:
                    chunk = None
            for ev in splitter.flush():
                out = self._inspect(ctx, ev, hide_usage)
                if out is not None:
                    yield out
            outcome = "done"
        except httpx.HTTPError as exc:
            outcome = "failed"
            self._failed(ctx.decision.worker, repr(exc), "stream_broken")
            yield error_event(f"worker {ctx.decision.worker} failed mid-stream: {type(exc).__name__}")
        finally:
            await upstream.aclose()
            self.pool.release(ctx.decision.worker, ctx.prefill_tokens, ctx.prompt.length, ctx.ttft_s is not None)
            if outcome == "done":
                await self._record(ctx)
            elif outcome == "cancelled":
                self.metrics.client_disconnects.inc()

    def _inspect(self, ctx: _Ctx, ev: SseEvent, hide_usage: bool) -> bytes | None:
        # Most events are one token of output: decoding their JSON only to forward them unchanged costs
        # more CPU than the rest of the relay. Decode only what kvgate needs: the first output (TTFT),
        # usage, and the reply of a chat turn it keeps.
        if ctx.ttft_s is not None and ctx.turn is None and b'"usage"' not in ev.raw:
            return ev.raw
        obj = ev.json()
        if obj is None:
            return ev.raw
        usage = Usage.parse(obj.get("usage"))
        if usage is not None:
            ctx.usage = usage
        choices = obj.get("choices")
        if ctx.ttft_s is None and isinstance(choices, list) and any(_has_output(c) for c in choices):
            ctx.ttft_s = self.clock.now() - ctx.started
            self.metrics.ttft.labels(ctx.model).observe(ctx.ttft_s)
            self.pool.first_token(ctx.decision.worker, ctx.prefill_tokens, ctx.prompt.length)
        if ctx.response_id is None and isinstance(obj.get("id"), str):
            ctx.response_id = obj["id"]
        if ctx.turn is not None and isinstance(choices, list):
            for ch in choices:  # with n > 1 each choice streams in its own chunks: keep choice 0's
                if isinstance(ch, dict) and ch.get("index", 0) == 0:
                    delta = ch.get("delta")
                    if isinstance(delta, dict):
                        ctx.reply.add_delta(delta)
                    if ch.get("finish_reason"):
                        ctx.reply.complete = True
        if hide_usage and choices == [] and usage is not None:
            return None
        if hide_usage and usage is not None:
            # continuous_usage_stats-style usage on a content chunk: strip just the field.
            obj.pop("usage", None)
            return b"data: " + json.dumps(obj).encode() + b"\n\n"
        return ev.raw

    # -- recording -----------------------------------------------------------------------------
    async def _record(self, ctx: _Ctx) -> None:
        wid = ctx.decision.worker
        if ctx.usage is None:
            self.metrics.missing_usage.inc()
        else:
            self.metrics.prompt_tokens.labels(wid).inc(ctx.usage.prompt_tokens)
            self.metrics.cached_tokens.labels(wid).inc(ctx.usage.cached_tokens)
            self.metrics.completion_tokens.labels(wid).inc(ctx.usage.completion_tokens)
            self.metrics.expected_vs_actual.labels(self.policy.name).observe(
                ctx.usage.cached_tokens - ctx.decision.expected_cached_tokens)
            self.metrics.expected_cached.labels(self.policy.name).inc(ctx.decision.expected_cached_tokens)
        u = ctx.usage or Usage(0, 0, 0)
        lost, cause, detail, cache_lost, cache_cause = 0, None, "", 0, None
        loss = ctx.turn.loss if ctx.turn is not None else None
        if loss is not None:
            lost, cause, detail = loss.lost, loss.cause, loss.detail
            if lost and cause:
                self.metrics.tokens_lost.labels(cause).inc(lost)
            if ctx.usage is not None:
                cache_lost, cache_cause = explain_cache(loss.best, u.cached_tokens, ctx.chosen_matched_tokens,
                                                        ctx.best_matched_tokens)
                if cache_lost and cache_cause:
                    self.metrics.tokens_lost.labels(cache_cause).inc(cache_lost)
        if ctx.turn is not None and ctx.reply.complete:
            self.turns.completed(ctx.ident.conversation_id, ctx.turn.canonical.messages, ctx.reply, ctx.response_id,
                                 ctx.turn.tools, ctx.model)
        cid = ctx.ident.conversation_id
        self.prefills.settle(cid, ctx.usage.cached_tokens if ctx.usage else None)
        tools = tuple(str((c.get("function") or {}).get("name") or "") for c in ctx.reply.calls.values())
        life = ctx.life
        try:
            life = self.tiers.completed(cid, ctx.ident.tenant, ctx.model, ctx.life, wid, tools,
                                        u.prompt_tokens + u.completion_tokens)
        except Exception as exc:  # advisory: a lifecycle bug must not lose the turn record
            log.warning("lifecycle of %s: %r", cid, exc)
        if ctx.turn is not None and not tools and ctx.reply.complete and self.settings.prefill.enabled:
            # Rendering the next-turn prefix costs a template pass over the history: after the response.
            task = asyncio.get_running_loop().create_task(self._after_answer(ctx, wid, ctx.turn.protocol))
            self._background.add(task)  # a task nobody references may be collected before it runs
            task.add_done_callback(self._background.discard)
        turn = TurnRecord(wid, ctx.decision.reason, u.prompt_tokens, u.cached_tokens, u.completion_tokens,
                          ctx.ttft_s, ctx.decision.expected_cached_tokens, lost, cause, detail, cache_lost,
                          cache_cause)
        now = self.clock.now()
        ident = ctx.ident

        def add_turn(current: Session | None) -> Session:
            return (current or Session(ident.conversation_id, ident.source)).with_turn(turn, now, lifecycle=life)

        try:
            # Compare-and-set: another request of this conversation (maybe on another gateway) may
            # have written meanwhile; its turn is kept.
            await self.sessions.update(ident.conversation_id, add_turn)
        except SessionStoreError as exc:
            self.metrics.session_store_errors.inc()
            log.warning("turn not recorded: %s", exc)


    async def _after_answer(self, ctx: _Ctx, wid: WorkerId, protocol: ModelProtocol) -> None:
        cid = ctx.ident.conversation_id
        try:
            self.prefills.after_answer(cid, ctx.ident.tenant, ctx.model, wid, self.turns.chain_tokens(cid),
                                       self.turns.next_turn_prefix(ctx.model, cid, protocol),
                                       self.prefix.block_size(ctx.model), self.settings.cost.p1_ms)
        except Exception as exc:  # advisory: a prefill decision never fails anything
            log.warning("background prefill decision for %s: %r", cid, exc)


def _has_output(choice: Any) -> bool:
    if not isinstance(choice, dict):
        return False
    if choice.get("text"):
        return True
    delta = choice.get("delta")
    return isinstance(delta, dict) and bool(
        delta.get("content") or delta.get("reasoning") or delta.get("reasoning_content") or delta.get("tool_calls"))


def _loads(content: bytes) -> dict[str, Any] | None:
    try:
        obj = json.loads(content)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return obj if isinstance(obj, dict) else None


async def _anext(it: AsyncIterator[bytes]) -> bytes:
    return await it.__anext__()


async def _wait_disconnect(request: Request) -> None:
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return
