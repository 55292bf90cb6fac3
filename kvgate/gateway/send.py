"""Sending a prepared request: pick a worker, send, and retry where that is safe.

The attempt loop drives the exchange's lifecycle (gateway/lifecycle.py: the status table, the slot, the
end) and executes its commands through the relay; this module does the I/O. Only a request the worker
never had goes to another worker (up to ``max_attempts`` workers): a refused
or timed-out connection, a failed write, or a 502/503/504 answer. A 502/503/504 is retried on one other
worker at most: it may come from a proxy in front of an engine the request itself killed, and a second
one says the request, not the worker, is the likelier cause. A worker that had the request and
failed on it is not handed the next one: a 500 is answered as the client's error (400
``upstream_request_failed``), a connection lost before the first byte as 502 (``upstream_connection_lost``
or ``upstream_timeout``). A worker's own 4xx answer goes back with its status and message, in OpenAI's
error shape whatever the engine's. After the first byte a failure ends the stream with an SSE error event
(``relay.py``). A client that disconnects closes the upstream request, which makes vLLM abort it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from kvgate import safejson
from kvgate.clock import Clock
from kvgate.config import GatewaySettings
from kvgate.errors import BadGateway, BadRequest, ServiceUnavailable, error_body
from kvgate.gateway.exchange import PATHS, ClientGone, Exchange, Prepared
from kvgate.gateway.lifecycle import ExchangeLifecycle, Failed, RetryElsewhere
from kvgate.gateway.relay import Relay
from kvgate.gateway.route import Router
from kvgate.gateway.telemetry import GatewayMetrics
from kvgate.gateway.upstream import Lost, NotSent, Upstream, UpstreamResponse
from kvgate.router.types import WorkerId

T = TypeVar("T")
log = logging.getLogger(__name__)


class Sender:
    def __init__(self, settings: GatewaySettings, router: Router, upstream: Upstream, clock: Clock,
                 metrics: GatewayMetrics, relay: Relay) -> None:
        self.settings = settings
        self.router = router
        self.pool = router.pool
        self.upstream = upstream
        self.clock = clock
        self.metrics = metrics
        self.relay = relay

    async def send(self, request: Request, p: Prepared) -> Response:
        plan = await self.router.plan(p)
        lc = self.router.lifecycle(p, plan, trust="own")
        last_error = ""
        for attempt in range(self.settings.max_attempts):
            if lc.exhausted:
                break
            decision = self.router.pick(p, plan, lc.tried)
            if decision is None:
                break
            if attempt > 0:
                self.metrics.retries.inc()
            cmds = lc.dispatched(decision, self.router.node(decision.worker), self.clock.now())
            ex = lc.current
            self.relay.execute(ex, cmds)
            outcome = await self._attempt(request, lc, ex)
            self.relay.attempted(ex, outcome)
            if isinstance(outcome, Response):
                return outcome
            last_error = outcome
        retry = {"Retry-After": str(self.settings.retry_after_s)}
        if not lc.tried:
            raise ServiceUnavailable(f"No healthy worker for model `{p.model}`.", code="no_healthy_worker",
                                     headers=retry)
        raise ServiceUnavailable(f"All {len(lc.tried)} attempted workers failed; last: {last_error}",
                                 code="upstream_failed", headers=retry)

    async def _attempt(self, request: Request, lc: ExchangeLifecycle, ex: Exchange) -> Response | str:
        """The response, or why this worker failed (the request may go to another)."""
        p, w = ex.prepared, ex.decision.worker
        handed_off = False  # once the relay or the record owns the exchange, its end gives the slot back
        try:
            worker = self.pool.get(w).config
            upstream = await until_disconnect(request, self.upstream.post(
                worker.url + PATHS[p.endpoint], p.payload,
                p.trace.upstream(ex, worker, {**p.headers, "content-type": "application/json"})), _close)
            status = upstream.status
            detail = await _error_text(upstream) if status >= 500 else ""
            verdict = lc.answered(status, self.clock.now(), detail)
            self.relay.execute(ex, verdict.commands)
            if isinstance(verdict, RetryElsewhere):
                return verdict.reason
            if isinstance(verdict, Failed):
                return await self._refused(ex, upstream, verdict, detail)
            if p.finish_prompt is not None and p.prompt_task is None:
                p.prompt_task = asyncio.ensure_future(self._finish_prompt(p, w))
            if p.stream:
                it = upstream.chunks()
                try:
                    first = await until_disconnect(request, anext(it))
                except StopAsyncIteration:
                    first = b""
                except ClientGone:
                    await upstream.close()  # the worker sees the disconnect and aborts
                    raise
                except Lost as exc:
                    await upstream.close()
                    self.relay.execute(ex, lc.lost(str(exc), "stream_before_first_byte", self.clock.now()).commands)
                    raise _lost(w, exc) from exc
                handed_off = True
                return StreamingResponse(self.relay.stream(lc, upstream, first, it), status_code=status,
                                         media_type="text/event-stream", headers=self.relay.headers(ex))
            try:
                content = await until_disconnect(request, upstream.read())
            finally:
                await upstream.close()
            # The worker is done with it: the exchange ends (the slot first, so what the turn's end decides,
            # a background prefill, sees the queue without this request); the proxy counts the answer.
            handed_off = True
            content = await self.relay.unary(lc, content, status, counted=False)
            return Response(content, status_code=status,
                            media_type=upstream.header("content-type") or "application/json",
                            headers=self.relay.headers(ex))
        except NotSent as exc:  # the worker never had the request: another one may take it
            retry = lc.unsent(str(exc), exc.kind, self.clock.now())
            self.relay.execute(ex, retry.commands)
            return retry.reason
        except Lost as exc:  # the worker had it and was lost: not handed to the next one
            self.relay.execute(ex, lc.lost(str(exc), exc.kind, self.clock.now()).commands)
            raise _lost(w, exc) from exc
        finally:
            if not handed_off:  # refused, failed, lost, or the client gone: only the slot goes back
                self.relay.execute(ex, lc.abandoned(self.clock.now()))

    async def _refused(self, ex: Exchange, upstream: UpstreamResponse, verdict: Failed, detail: str) -> Response:
        w, status = ex.decision.worker, upstream.status
        if verdict.answer == "worker":
            # The worker judged the request; its answer goes back, in OpenAI's shape.
            try:
                content = await upstream.read()
            finally:
                await upstream.close()
            content, media = worker_error(content, status, upstream.header("content-type"))
            return Response(content, status_code=status, media_type=media, headers=self.relay.headers(ex))
        raise BadRequest(f"Worker {w} failed while processing this request (HTTP {status}: {detail}); it was not "
                         "retried on another worker.", code="upstream_request_failed")

    async def _finish_prompt(self, p: Prepared, w: WorkerId) -> None:
        """The rest of a prompt routed on its head, tokenized beside the event loop (tokenizers release
        the GIL); the worker's approximate index then learns all the blocks it was sent."""
        assert p.finish_prompt is not None
        try:
            p.prompt = await asyncio.to_thread(p.finish_prompt)
        except Exception as exc:  # any tokenizer failure: the head stays, the turn's chain is built from it
            log.warning("completing a prompt's tokens failed: %s", exc)
            return
        self.router.accepted(p, w)


WORKER_ERROR_BYTES = 64 * 1024
"""A worker's error answer longer than this is not parsed (it is no error message a client can use whole)."""


def worker_error(content: bytes, status: int, media: str | None) -> tuple[bytes, str | None]:
    """A worker's 4xx answer in OpenAI's shape ``{"error": {message, type, param, code}}``: vLLM's already is;
    SGLang (and vLLM before 0.10) answer ``{"object": "error", "message", "type", ...}``, vLLM's --api-key
    check ``{"error": "Unauthorized"}``, a proxy in front of a worker plain text. Already in shape: unchanged."""
    doc: Any = None
    if len(content) <= WORKER_ERROR_BYTES:
        ok, doc = safejson.try_loads(content.decode("utf-8", "replace"))
        if not ok:
            doc = None
    if isinstance(doc, dict) and isinstance(doc.get("error"), dict) and isinstance(doc["error"].get("message"), str):
        return content, media
    src = doc if isinstance(doc, dict) else {}
    message = src.get("message") if isinstance(src.get("message"), str) else src.get("error")
    if not isinstance(message, str) or not message:
        message = content[:500].decode("utf-8", "replace").strip() or f"The worker answered HTTP {status}."
    type_ = src.get("type")
    if not isinstance(type_, str) or not type_:
        type_ = "not_found_error" if status == 404 else "invalid_request_error"
    param = src.get("param") if isinstance(src.get("param"), str) else None
    code = src.get("code") if isinstance(src.get("code"), str | int) and not isinstance(src.get("code"), bool) \
        else status
    return json.dumps(error_body(message, type_, param, code)).encode(), "application/json"


def _lost(w: WorkerId, exc: Lost) -> BadGateway:
    return BadGateway(f"Worker {w} was lost while processing this request ({exc}); it was not retried on "
                      "another worker.", code="upstream_timeout" if exc.timeout else "upstream_connection_lost")


async def _error_text(upstream: UpstreamResponse) -> str:
    try:
        return (await upstream.read())[:200].decode(errors="replace")
    except Lost:  # a worker that dies right after its status line
        return ""
    finally:
        await upstream.close()


async def _close(resp: UpstreamResponse) -> None:
    await resp.close()


async def until_disconnect(request: Request, aw: Awaitable[T],
                           late: Callable[[T], Awaitable[None]] | None = None) -> T:
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
            if late is not None and not task.cancelled() and task.exception() is None:
                await late(task.result())


async def _wait_disconnect(request: Request) -> None:
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return
