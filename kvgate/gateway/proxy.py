"""Forwarding one request: prepare (validate, identify, canonicalise, tokenize) → route and send (the
attempt loop) → relay (SSE) → record (the outcome, through the session controller, into the
conversation's record). Each step is its own module; this one runs them and answers errors."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from kvgate.admission.gate import Ticket
from kvgate.errors import ApiError, BadRequest, ServiceUnavailable
from kvgate.gateway.auth import Authenticator, Principal, require
from kvgate.gateway.exchange import PATHS, ClientGone, Endpoint, Prepared
from kvgate.gateway.front import Front
from kvgate.gateway.prepare import Preparer
from kvgate.gateway.send import Sender
from kvgate.gateway.telemetry import GatewayMetrics
from kvgate.gateway.tracing import Tracing

log = logging.getLogger(__name__)


class Proxy:
    def __init__(self, preparer: Preparer, sender: Sender, metrics: GatewayMetrics, tracing: Tracing | None = None,
                 auth: Authenticator | None = None, shed: Callable[[], bool] | None = None) -> None:
        self.shed = shed
        """True while kvgate's own event loop runs late (gateway/looplag.py): new requests are refused
        before anything is spent on them."""
        self.auth = auth
        self.preparer = preparer
        self.sender = sender
        self.metrics = metrics
        self.tracing = tracing or Tracing()

    async def handle(self, request: Request, endpoint: Endpoint, front: Front | None = None) -> Response:
        """``front``: a door of another protocol (gateway/front.py) over the chat pipeline."""
        trace = self.tracing.request(request.headers, PATHS[endpoint] if front is None else request.url.path)
        ticket: Ticket | None = None
        resp: Response | None = None
        try:
            if self.shed is not None and self.shed():
                self.metrics.shed.inc()
                raise ServiceUnavailable("kvgate is overloaded; retry later.", code="overloaded",
                                         headers={"Retry-After": str(self.preparer.settings.retry_after_s)})
            principal = require(self.auth, request.headers, proxy=True) if self.auth is not None else None
            try:
                translate = None if front is None else self._translator(front, request, principal)
                prepared = await self.preparer.prepare(request, endpoint, trace, principal, translate)
                if front is not None:
                    prepared.retain_s = front.retain_s
            except (ApiError, ClientGone):
                raise
            except ClientDisconnect:
                # Gone while its body was still arriving (or its framing was broken, which makes the
                # server drop it): no one to answer, and not a validation gap.
                raise ClientGone() from None
            except Exception as exc:
                # Preparing reads only the client's request (and the conversation it names): whatever
                # input gets past validation and still breaks it is the client's input, answered 400,
                # not a 500 that reads as the gateway failing. Logged whole: it is a validation gap.
                log.exception("request input broke preparation")
                raise BadRequest(f"The request could not be processed: {type(exc).__name__}: {str(exc)[:200]}",
                                 code="invalid_request") from exc
            ticket = prepared.ticket
            resp = await self.sender.send(request, prepared)
            if front is not None:
                resp = await _translated(front, resp, prepared)
        except ApiError as exc:
            resp = exc.response() if front is None else \
                JSONResponse(front.error(exc.status, exc), status_code=exc.status, headers=exc.headers)
        except ClientGone:
            self.metrics.client_disconnects.inc()
            resp = Response(status_code=499)
        finally:
            # A stream holds its admission until it ends; anything else (answered, refused, failed, the
            # client gone, this handler cancelled) has ended here.
            if ticket is not None and not isinstance(resp, StreamingResponse):
                ticket.release()
        assert resp is not None
        if not isinstance(resp, StreamingResponse):  # a stream is counted when it ends (relay.py)
            self.metrics.count_request(endpoint, resp.status_code)
            trace.finish(resp.status_code)
        elif ticket is not None:
            resp = _Admitted(ticket, resp.body_iterator, resp.status_code, dict(resp.headers))
        return resp


    def _translator(self, front: Front, request: Request, principal: Principal | None
                    ) -> Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]:
        auth = self.preparer.settings.auth
        tenant = principal.tenant if principal is not None and auth.enabled else \
            request.headers.get(self.preparer.settings.tenant_header, "")

        def translate(body: dict[str, Any]) -> Awaitable[dict[str, Any]]:
            return front.to_chat(body, request.headers, tenant)

        return translate


_DROP = ("content-length", "content-type")
"""Headers of the chat answer that do not describe the translated one."""


async def _translated(front: Front, resp: Response, prepared: Prepared) -> Response:
    headers = {k: v for k, v in resp.headers.items() if k not in _DROP}
    if isinstance(resp, StreamingResponse):
        if 200 <= resp.status_code < 300:
            chat = _as_bytes(resp.body_iterator)
            return StreamingResponse(_closing(front.from_stream(chat, prepared), chat),
                                     status_code=resp.status_code, headers=headers, media_type="text/event-stream")
        return resp
    try:
        obj = json.loads(bytes(resp.body)) if resp.body else {}
    except ValueError:
        obj = {}
    if not isinstance(obj, dict):
        obj = {}
    if 200 <= resp.status_code < 300:
        return JSONResponse(await front.from_json(obj, prepared), status_code=resp.status_code, headers=headers)
    return JSONResponse(front.error(resp.status_code, obj), status_code=resp.status_code, headers=headers)


async def _as_bytes(it: AsyncIterable[str | bytes | memoryview]) -> AsyncGenerator[bytes, None]:
    try:
        async for chunk in it:
            yield chunk.encode() if isinstance(chunk, str) else bytes(chunk)
    finally:
        close = getattr(it, "aclose", None)
        if close is not None:
            await close()


async def _closing(out: AsyncIterator[bytes], chat: AsyncGenerator[bytes, None]) -> AsyncIterator[bytes]:
    """The translated stream, closing the chat stream under it when it ends or its client leaves: the
    relay's ending (the worker's stream closed, the outcome recorded) must not wait for the collector."""
    try:
        async for chunk in out:
            yield chunk
    finally:
        aclose = getattr(out, "aclose", None)
        if aclose is not None:
            await aclose()
        await chat.aclose()


class _Admitted(StreamingResponse):
    """A stream that releases its admission ticket when it is over: ended, broken, or its client gone
    (Starlette cancels the response; the relay closes the worker's stream the same way). Released around
    the whole response, not inside its body, so a stream cancelled before its first chunk releases too."""

    def __init__(self, ticket: Ticket, content: AsyncIterable[str | bytes | memoryview], status_code: int,
                 headers: dict[str, str]) -> None:
        super().__init__(content, status_code=status_code, headers=headers)
        self.ticket = ticket

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.ticket.release()
