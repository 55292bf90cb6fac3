"""Forwarding one request: prepare (validate, identify, canonicalise, tokenize) → route and send (the
attempt loop) → relay (SSE) → record (the outcome, through the session controller, into the
conversation's record). Each step is its own module; this one runs them and answers errors."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterable

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from kvgate.admission.gate import Ticket
from kvgate.errors import ApiError, BadRequest
from kvgate.gateway.auth import Authenticator, require
from kvgate.gateway.exchange import PATHS, ClientGone, Endpoint
from kvgate.gateway.prepare import Preparer
from kvgate.gateway.send import Sender
from kvgate.gateway.telemetry import GatewayMetrics
from kvgate.gateway.tracing import Tracing

log = logging.getLogger(__name__)


class Proxy:
    def __init__(self, preparer: Preparer, sender: Sender, metrics: GatewayMetrics, tracing: Tracing | None = None,
                 auth: Authenticator | None = None) -> None:
        self.auth = auth
        self.preparer = preparer
        self.sender = sender
        self.metrics = metrics
        self.tracing = tracing or Tracing()

    async def handle(self, request: Request, endpoint: Endpoint) -> Response:
        trace = self.tracing.request(request.headers, PATHS[endpoint])
        ticket: Ticket | None = None
        resp: Response | None = None
        try:
            principal = require(self.auth, request.headers, proxy=True) if self.auth is not None else None
            try:
                prepared = await self.preparer.prepare(request, endpoint, trace, principal)
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
        except ApiError as exc:
            resp = exc.response()
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
