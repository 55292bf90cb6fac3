"""OpenTelemetry traces of the request path and of the background work (docs/operations.md, "Traces").

One trace per client request: a SERVER span (``POST /v1/chat/completions``) that continues the incoming
``traceparent``, with children ``identify``, ``canonicalise``, ``tokenize``, ``session``, ``route``,
``{operation} {model}`` (the CLIENT span of the worker call, GenAI semantic conventions, TTFT as its
``first_token`` event), ``relay`` and ``record``. The worker gets the CLIENT span's context in
``traceparent``, so a vLLM started with ``--otlp-traces-endpoint`` puts its ``llm_request`` span under it.
A turn's record keeps its trace and span ids; background prefills and prefetches are traces of their
own whose root links to the span of the turn that led to them.

Configured by the standard variables: on when ``OTEL_TRACES_EXPORTER`` names an exporter or an OTLP
endpoint is set (``OTEL_EXPORTER_OTLP[_TRACES]_ENDPOINT``, protocol ``OTEL_EXPORTER_OTLP[_TRACES]_PROTOCOL``,
the exporter from ``kvgate[otel]``), sampled by ``OTEL_TRACES_SAMPLER``/``_ARG`` (parent-based always-on by
default), named by ``OTEL_SERVICE_NAME``/``OTEL_RESOURCE_ATTRIBUTES``; ``OTEL_SDK_DISABLED=true`` turns it off.

Off, every call of the request path lands on ``OFF``, whose methods return at once, and the client's
``traceparent`` goes to the worker unchanged. The prepare steps are timed by ``mark`` (a clock read) and
become spans only when routing starts, with attributes read from the prepared request, so the request
path carries one-line calls and no attribute code.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.trace import Link, Span, SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from kvgate.gateway import spans

if TYPE_CHECKING:
    from kvgate.config import WorkerConfig
    from kvgate.gateway.exchange import Exchange, Prepared
    from kvgate.gateway.route import Plan
    from kvgate.router.types import Decision
    from kvgate.session.conversation import Conversation, TurnRecord

log = logging.getLogger(__name__)

_PROPAGATOR = TraceContextTextMapPropagator()
TRACE_HEADERS = ("traceparent", "tracestate")


# -- configuration -------------------------------------------------------------------------------
def provider_from_env(environ: Mapping[str, str] | None = None) -> TracerProvider | None:
    """The tracer provider the ``OTEL_*`` variables describe, or None when tracing is off."""
    env = os.environ if environ is None else environ
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    names = [n.strip() for n in env.get("OTEL_TRACES_EXPORTER", "otlp" if endpoint else "none").split(",")]
    exporters = [_exporter(n, env) for n in names if n and n != "none"]
    if not exporters:
        return None
    resource = Resource.create()
    if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
        resource = resource.merge(Resource({"service.name": "kvgate"}))
    provider = TracerProvider(resource=resource)  # the sampler from OTEL_TRACES_SAMPLER
    for e in exporters:
        provider.add_span_processor(BatchSpanProcessor(e))  # OTEL_BSP_* bound its queue
    return provider


def _exporter(name: str, env: Mapping[str, str]) -> SpanExporter:
    if name == "console":
        return ConsoleSpanExporter()
    if name != "otlp":
        raise ValueError(f"OTEL_TRACES_EXPORTER={name!r}: kvgate supports otlp, console and none")
    protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") \
        or "http/protobuf"
    try:
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as Grpc

            return cast(SpanExporter, Grpc())
        if protocol == "http/protobuf":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as Http

            return Http()
    except ImportError as exc:
        raise ValueError(f"the OTLP {protocol} exporter is not installed: pip install 'kvgate[otel]' ({exc})"
                         ) from exc
    raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r}: expected grpc or http/protobuf")


# -- the request path ----------------------------------------------------------------------------
class RequestTrace:
    """A request's trace as the request path sees it. This base class is the disabled one: every method
    returns at once (``OFF``); ``LiveTrace`` records."""

    __slots__ = ()

    def mark(self, step: str) -> None:
        """The prepare step ``step`` starts now (the one before it ends)."""

    def routing(self, p: Prepared) -> None:
        """Routing starts: the prepare steps become spans, with what ``p`` says of them."""

    def routed(self, p: Prepared, plan: Plan, decision: Decision | None, policy: str) -> None:
        """A routing decision (one per attempt): the ``route`` span."""

    def upstream(self, ex: Exchange, worker: WorkerConfig, headers: dict[str, str]) -> dict[str, str]:
        """The worker call starts; returns the headers to send it (the call's ``traceparent``)."""
        return headers

    def attempted(self, ex: Exchange, outcome: object) -> None:
        """An attempt returned: a response, or the reason its worker failed (a string)."""

    def first_token(self, ex: Exchange) -> None:
        """The first output reached the gateway."""

    def answered(self, ex: Exchange) -> None:
        """A non-streamed answer was read."""

    def streamed(self, ex: Exchange, outcome: str) -> None:
        """A stream ended: ``done``, ``cancelled`` (the client left) or ``failed`` (the worker did)."""

    def recorded(self, turn: TurnRecord) -> None:
        """The outcome was recorded in the conversation's record."""

    def finish(self, status: int | str) -> None:
        """The request is over (its status as counted in ``kvgate_requests_total``)."""

    def ids(self) -> tuple[str, str]:
        """(trace id, span id) of the request's span in hex; empty when not traced."""
        return "", ""


OFF = RequestTrace()


class LiveTrace(RequestTrace):
    __slots__ = ("_open", "_root", "_root_ctx", "_route_at", "_steps", "_tracer", "_upstream", "_upstream_at")

    def __init__(self, tracer: trace.Tracer, root: Span) -> None:
        self._tracer = tracer
        self._root = root
        self._root_ctx = trace.set_span_in_context(root)
        self._steps: list[tuple[str, int, int, Mapping[str, Any] | None]] = []
        """Timed steps not yet made spans: (name, start, end, attributes or None)."""
        self._open: tuple[str, int] | None = None
        self._upstream: Span | None = None
        self._upstream_at = 0
        self._route_at = 0

    def _child(self, name: str, start: int, kind: SpanKind = SpanKind.INTERNAL) -> Span:
        return self._tracer.start_span(name, self._root_ctx, kind, start_time=start)

    def _close(self, now: int, attributes: Mapping[str, Any] | None = None) -> None:
        if self._open is not None:
            self._steps.append((*self._open, now, attributes))
            self._open = None

    def _emit(self, p: Prepared | None = None, failed: bool = False) -> None:
        """The timed steps become spans (attributes from ``p`` for the prepare steps)."""
        self._close(time.time_ns())
        last = len(self._steps) - 1
        for i, (name, start, end, attributes) in enumerate(self._steps):
            span = self._child(name, start)
            if attributes is None and p is not None:
                attributes = spans.step_attributes(name, p)
            if attributes:
                span.set_attributes(attributes)
            if failed and i == last:
                span.set_status(Status(StatusCode.ERROR))
            span.end(end)
        self._steps.clear()

    def mark(self, step: str) -> None:
        now = time.time_ns()
        self._close(now)
        self._open = (step, now)

    def routing(self, p: Prepared) -> None:
        self._emit(p)
        self._root.set_attributes(spans.request_attributes(p))
        self._route_at = time.time_ns()

    def routed(self, p: Prepared, plan: Plan, decision: Decision | None, policy: str) -> None:
        span = self._child("route", self._route_at or time.time_ns())
        span.set_attributes(spans.route_attributes(p, plan, decision, policy))
        if decision is None:
            span.set_status(Status(StatusCode.ERROR, "no eligible worker"))
        span.end()

    def upstream(self, ex: Exchange, worker: WorkerConfig, headers: dict[str, str]) -> dict[str, str]:
        self._end_upstream("superseded")
        p = ex.prepared
        self._upstream_at = time.time_ns()
        self._upstream = span = self._child(f"{spans.operation(p)} {p.model}", self._upstream_at, SpanKind.CLIENT)
        span.set_attributes(spans.upstream_attributes(ex, worker))
        out = {k: v for k, v in headers.items() if k not in TRACE_HEADERS}
        _PROPAGATOR.inject(out, trace.set_span_in_context(span))
        return out

    def _end_upstream(self, error: str | None, end: int | None = None) -> None:
        span, self._upstream = self._upstream, None
        if span is None:
            return
        if error is not None:
            span.set_attribute("error.type", error)
            span.set_status(Status(StatusCode.ERROR, error))
        span.end(end)

    def attempted(self, ex: Exchange, outcome: object) -> None:
        if isinstance(outcome, str):  # the worker never had it: the next attempt goes elsewhere
            self._end_upstream(outcome)
            self._route_at = time.time_ns()
            return
        status = getattr(outcome, "status_code", 0)
        if self._upstream is not None and (status >= 400 or not ex.prepared.stream):
            self._upstream.set_attribute("http.response.status_code", status)
            self._end_upstream(str(status) if status >= 400 else None)

    def first_token(self, ex: Exchange) -> None:
        if self._upstream is not None and ex.ttft_s is not None:
            self._upstream.add_event("first_token", {"kvgate.ttft_s": ex.ttft_s})
            self._upstream.set_attribute("gen_ai.response.time_to_first_chunk", ex.ttft_s)

    def _response(self, ex: Exchange, error: str | None, end: int | None) -> None:
        if self._upstream is not None:
            self._upstream.set_attributes(spans.response_attributes(ex))
            self._upstream.set_attribute("http.response.status_code", 200)
        self._end_upstream(error, end)

    def answered(self, ex: Exchange) -> None:
        # The body was read when the relay step began: the worker call ended there.
        self._response(ex, None, self._open[1] if self._open is not None else None)
        self._close(time.time_ns(), spans.relay_attributes(ex, "done"))

    def streamed(self, ex: Exchange, outcome: str) -> None:
        self._response(ex, "stream_broken" if outcome == "failed" else None, None)
        self._close(time.time_ns(), spans.relay_attributes(ex, outcome))
        if outcome == "failed":
            self._emit(failed=True)

    def recorded(self, turn: TurnRecord) -> None:
        self._close(time.time_ns(), spans.record_attributes(turn))
        self._emit()

    def finish(self, status: int | str) -> None:
        code = int(status)
        self._end_upstream(str(code) if code >= 500 else None)
        self._emit(failed=code >= 400)
        self._root.set_attribute("http.response.status_code", code)
        if code >= 500:
            self._root.set_attribute("error.type", str(code))
            self._root.set_status(Status(StatusCode.ERROR))
        self._root.end()

    def ids(self) -> tuple[str, str]:
        ctx = self._root.get_span_context()
        return f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}"


class _Unsampled(RequestTrace):
    """A request the sampler dropped: nothing is recorded, but the worker still gets the trace's
    context (with the sampled flag off), so the trace stays one across the hop."""

    __slots__ = ("_ctx",)

    def __init__(self, ctx: otel_context.Context) -> None:
        self._ctx = ctx

    def upstream(self, ex: Exchange, worker: WorkerConfig, headers: dict[str, str]) -> dict[str, str]:
        out = {k: v for k, v in headers.items() if k not in TRACE_HEADERS}
        _PROPAGATOR.inject(out, self._ctx)
        return out


# -- one gateway's tracing -----------------------------------------------------------------------
class Tracing:
    def __init__(self, provider: TracerProvider | None = None, *, owned: bool = False) -> None:
        self.provider = provider
        self._owned = owned
        self._tracer = provider.get_tracer("kvgate") if provider is not None else None

    @classmethod
    def from_env(cls) -> Tracing:
        return cls(provider_from_env(), owned=True)

    @property
    def enabled(self) -> bool:
        return self._tracer is not None

    def request(self, headers: Mapping[str, str], path: str) -> RequestTrace:
        tracer = self._tracer
        if tracer is None:
            return OFF
        parent = _PROPAGATOR.extract(headers) if "traceparent" in headers else None
        root = tracer.start_span(f"POST {path}", parent, SpanKind.SERVER, attributes={
            "http.request.method": "POST", "http.route": path, "url.path": path})
        if not root.is_recording():
            return _Unsampled(trace.set_span_in_context(root))
        return LiveTrace(tracer, root)

    def background(self, kind: str, conv: Conversation, worker: str) -> Span | None:
        """The root span of a background job (``prefill``, ``prefetch``) of ``conv``, linked to the
        span of its last turn; None when tracing is off."""
        if self._tracer is None:
            return None
        links = []
        last = conv.turns[-1] if conv.turns else None
        if last is not None and last.trace_id:
            links.append(Link(SpanContext(int(last.trace_id, 16), int(last.span_id, 16), is_remote=True,
                                          trace_flags=TraceFlags(TraceFlags.SAMPLED))))
        return self._tracer.start_span(f"kvgate {kind}", None, SpanKind.INTERNAL, links=links, attributes={
            "gen_ai.conversation.id": conv.id, "kvgate.background": kind, "kvgate.worker": worker,
            "gen_ai.request.model": conv.model})

    def client(self, name: str) -> Span | None:
        """A CLIENT span under the background span running now; None outside one."""
        if self._tracer is None or not trace.get_current_span().is_recording():
            return None
        return self._tracer.start_span(name, kind=SpanKind.CLIENT)

    def shutdown(self) -> None:
        """Flush what is queued (the process is stopping)."""
        if self._owned and self.provider is not None:
            self.provider.shutdown()


# -- background work -----------------------------------------------------------------------------
class _HasTracing(Protocol):
    tracing: Tracing


F = TypeVar("F", bound=Callable[..., Awaitable[None]])


def background(kind: str) -> Callable[[F], F]:
    """Run a background job ``(self, conversation id, conversation, command, ...)`` of a runtime that has
    a ``tracing`` in a trace of its own (``Tracing.background``), current while it runs: its worker
    calls are ``client`` spans under it."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        async def run(self: _HasTracing, cid: Any, conv: Conversation, cmd: Any, *a: Any, **kw: Any) -> None:
            span = self.tracing.background(kind, conv, str(getattr(cmd, "worker", "")))
            if span is None:
                return await fn(self, cid, conv, cmd, *a, **kw)
            token = otel_context.attach(trace.set_span_in_context(span))
            try:
                await fn(self, cid, conv, cmd, *a, **kw)
            except BaseException as exc:
                span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
                raise
            finally:
                otel_context.detach(token)
                span.end()
            return None

        return cast(F, run)

    return wrap


def client(name: str) -> Callable[[F], F]:
    """Run a background job's worker call ``(self, ...)`` in a CLIENT span under the job's span (when it
    is traced); ``current_headers`` then carries that span to the worker."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        async def run(self: _HasTracing, *a: Any, **kw: Any) -> None:
            span = self.tracing.client(name)
            if span is None:
                return await fn(self, *a, **kw)
            token = otel_context.attach(trace.set_span_in_context(span))
            try:
                await fn(self, *a, **kw)
            finally:
                otel_context.detach(token)
                span.end()
            return None

        return cast(F, run)

    return wrap


def note(**attributes: Any) -> None:
    """Attributes on the background span running now (nothing when there is none)."""
    span = trace.get_current_span()
    if span.is_recording():
        span.set_attributes({k: v for k, v in attributes.items() if v is not None})


def current_headers() -> dict[str, str]:
    """``traceparent`` of the span running now, for a worker call made by background work ({} outside
    a traced job)."""
    headers: dict[str, str] = {}
    if trace.get_current_span().get_span_context().is_valid:
        _PROPAGATOR.inject(headers)
    return headers
