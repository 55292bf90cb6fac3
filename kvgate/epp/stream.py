"""One HTTP request's ext_proc stream: Envoy sends its phases, kvgate answers each as the endpoint picker
protocol and the body send mode require.

Request side. FULL_DUPLEX_STREAMED (what inference gateways configure): the headers and every body
chunk are read without an answer; at the end of the body the request is prepared exactly as the proxy
prepares it (identity, canonical history, tokenization, the session controller's arrival), routed with
the cost model, and answered with the headers response (the pick in ``x-gateway-destination-endpoint``
and in ``envoy.lb`` metadata, ``content-length`` of the new body) followed by the new body in chunks.
BUFFERED: the headers are answered at once without a change, then the one body message is answered
with the same mutations in a body response (header mutations are honoured there in that mode only).

Response side: the worker's status and headers (kvgate's ``x-kvgate-*`` headers are added), then its
body: an SSE stream is read event by event and passed on as it comes (TTFT, usage and the reply are
read on the way, usage the client did not ask for is removed), a JSON answer is read whole; at the end
the turn is recorded through the same ``Recorder`` as in proxy mode, before the last chunk goes back,
so the client never sees the end of a response whose turn is not recorded yet. A stream that ends
before that (the client went away, Envoy gave up) releases the worker slot and records nothing.

Tenants as in proxy mode: with auth on, every request Envoy asks about is authenticated from the client's
headers Envoy passes on (the tenant is the credential's, its salt goes into the body, the client's
credential is replaced by the workers' key when epp_auth authenticated the caller, or removed); with
admission on, the request is admitted before it is prepared and holds its admission until the ext_proc
stream ends, which is when Envoy is done with the response (or gave up on it).

The response's status is the caller's claim: it settles this request, never the worker's health
(kvgate/epp/probe.py).
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

from kvgate.epp import protocol as proto
from kvgate.epp.endpoints import endpoint_of, outside
from kvgate.errors import ApiError, BadRequest, PayloadTooLarge, ServiceUnavailable
from kvgate.gateway.auth import Principal, require
from kvgate.gateway.exchange import PATHS as ENDPOINT_PATHS
from kvgate.gateway.exchange import Endpoint, Exchange, Prepared
from kvgate.gateway.lifecycle import ExchangeLifecycle, Outcome
from kvgate.gateway.prepare import parse_object
from kvgate.gateway.sse import SseEvent, SseSplitter
from kvgate.grpc.gen.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from kvgate.router.types import Decision, WorkerId

if TYPE_CHECKING:
    from kvgate.epp.probe import EarlyProbe
    from kvgate.epp.service import EppMetrics
    from kvgate.gateway.parts import Parts

PATHS: dict[str, Endpoint] = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}
MAX_RESPONSE_BYTES = 64 << 20
"""A JSON answer is read whole to record it; past this it is passed on unread and not recorded."""


class Unsupported(Exception):
    """The filter is configured in a way the endpoint picker cannot serve (ends the stream)."""


class OutOfOrder(Exception):
    """A request phase after the request was decided (ends the stream). Envoy sends none; answering one
    would prepare and route the request a second time, and the first pick's worker slot and admission
    ticket would never be given back."""


class EppStream:
    def __init__(self, gw: Parts, metrics: EppMetrics | None = None, trusted: bool = False,
                 probe: EarlyProbe | None = None) -> None:
        self.gw = gw
        self.m = gw.metrics
        self.epp_metrics = metrics
        self.trusted = trusted
        """The caller passed epp_auth (the data plane): only then may an answer carry the workers' key."""
        self.probe = probe
        default = proto.BUFFERED if gw.settings.epp_body_mode == "buffered" else proto.FULL_DUPLEX
        self.req_mode: int = default
        self.resp_mode: int = default
        self.headers: dict[str, str] = {}
        self.body = bytearray()
        self.body_done = False
        self.body_seen = False
        self.body_eos = False
        self.headers_answered = False
        self.subset: list[str] | None = None
        self.lc: ExchangeLifecycle | None = None
        """The exchange with the picked worker (gateway/lifecycle.py): this stream drives it, the relay
        executes its commands, as the proxy's sender does."""
        self.kind: Endpoint | None = None
        self.status = 0
        self.sse = False
        self.splitter = SseSplitter()
        self.held = bytearray()
        self.finished = False
        self.passthrough = False
        self.done = False
        """Nothing more to answer (an immediate response went out)."""
        self.decided_at: float | None = None
        self.prepared: Prepared | None = None
        self.trace_headers: dict[str, str] = {}
        """The worker call's trace context (``traceparent``), set on the request Envoy forwards."""
        """Set once prepared: its admission ticket is released when the stream ends."""

    @property
    def ex(self) -> Exchange | None:
        return self.lc.ex if self.lc is not None else None

    # -- the stream ------------------------------------------------------------------------------
    async def handle(self, req: ep.ProcessingRequest) -> list[ep.ProcessingResponse]:
        if req.HasField("protocol_config"):
            self._modes(req.protocol_config)
        which = req.WhichOneof("request")
        if which in ("request_headers", "request_body") and self.body_done:
            raise OutOfOrder(f"{which} after the end of the request")
        if which == "request_headers":
            return await self._request_headers(req)
        if which == "request_body":
            return await self._request_body(req.request_body)
        if which == "request_trailers":
            out = [] if self.body_done else await self._decide()
            return out + ([] if self.done else [ep.ProcessingResponse(request_trailers=ep.TrailersResponse())])
        if which == "response_headers":
            return self._response_headers(req)
        if which == "response_body":
            return await self._response_body(req.response_body)
        if which == "response_trailers":
            out = [] if self.finished else await self._finish_sse(final=True)
            return [*out, ep.ProcessingResponse(response_trailers=ep.TrailersResponse())]
        return []

    def _modes(self, pc: ep.ProtocolConfiguration) -> None:
        for mode in (pc.request_body_mode, pc.response_body_mode):
            if mode not in (proto.FULL_DUPLEX, proto.BUFFERED, 0):
                raise Unsupported(f"body send mode {mode}: the endpoint picker needs the whole request body before "
                                  "Envoy routes (FULL_DUPLEX_STREAMED or BUFFERED)")
        self.req_mode = pc.request_body_mode or self.req_mode
        self.resp_mode = pc.response_body_mode or self.resp_mode

    def close(self) -> None:
        """The stream ended: Envoy is done with the request. Its admission ends here; a request whose
        response did not complete gave up its worker slot here."""
        if self.prepared is not None and self.prepared.ticket is not None:
            self.prepared.ticket.release()
        ex = self.ex
        if ex is None or self.finished:
            return
        self.finished = True
        self._end("cancelled")

    # -- request -------------------------------------------------------------------------------
    async def _request_headers(self, req: ep.ProcessingRequest) -> list[ep.ProcessingResponse]:
        h = req.request_headers
        self.headers = proto.headers_of(h.headers)
        self.subset = proto.subset_of(req)
        method = self.headers.get(":method", "POST").upper()
        self.kind = PATHS.get(self.headers.get(":path", "").split("?", 1)[0]) if method == "POST" else None
        declared = self.headers.get("content-length", "")
        limit = self.gw.settings.max_body_bytes
        length = proto.unsigned(declared)
        if length is not None and length > limit:
            return self._error(PayloadTooLarge(f"Request body of {declared} bytes exceeds the limit of {limit} "
                                               "bytes.", code="request_too_large"))
        if h.end_of_stream or self.req_mode == 0:
            return await self._decide()  # no body will come: pick on what there is
        if self.req_mode == proto.BUFFERED:
            self.headers_answered = True
            return [ep.ProcessingResponse(request_headers=ep.HeadersResponse(response=ep.CommonResponse()))]
        return []

    async def _request_body(self, b: ep.HttpBody) -> list[ep.ProcessingResponse]:
        self.body += b.body
        self.body_seen = True
        self.body_eos = b.end_of_stream
        limit = self.gw.settings.max_body_bytes
        if len(self.body) > limit:
            return self._error(PayloadTooLarge(f"Request body exceeds the limit of {limit} bytes.",
                                               code="request_too_large"))
        if b.end_of_stream:
            return await self._decide()
        if self.req_mode == proto.BUFFERED:  # BUFFERED_PARTIAL cut the body at Envoy's buffer limit
            return self._error(PayloadTooLarge("Request body exceeds Envoy's buffer limit.", code="request_too_large"))
        return []

    async def _decide(self) -> list[ep.ProcessingResponse]:
        self.body_done = True
        t0 = time.perf_counter()
        try:
            principal = self._principal()
            if self.kind is None:
                return self._forward(await self._fallback(), bytes(self.body), changed=False)
            preparer = self.gw.proxy.preparer
            # Traced as in proxy mode: the request's span from Envoy's traceparent, the worker call's
            # context sent on to the worker through Envoy.
            trace = self.gw.tracing.request(self.headers, ENDPOINT_PATHS[self.kind])
            self.prepared = p = await preparer.prepare_body(await self._json(), self.headers, self.kind,
                                                            principal=principal, admit=preparer.admission is not None,
                                                            trace=trace)
            endpoints = await self._route(p)
            assert self.ex is not None
            self.trace_headers = p.trace.upstream(self.ex, self.gw.pool.get(self.ex.decision.worker).config, {})
            return self._forward(endpoints, p.payload, changed=True)
        except ApiError as exc:
            return self._error(exc)
        finally:
            if self.epp_metrics is not None:
                self.epp_metrics.decision.observe(time.perf_counter() - t0)

    def _principal(self) -> Principal | None:
        """Auth on: who is calling, from the headers Envoy passes on (401 / 403 as the proxy answers).
        Every request, routed by prefix or not: whatever Envoy forwards reaches a worker with the workers'
        key."""
        auth = self.gw.auth
        return require(auth, self.headers, proxy=True) if auth.settings.enabled else None

    def _credentials(self) -> ep.HeaderMutation:
        """The workers' credential instead of the client's: the client's key is kvgate's, never the worker's.
        The workers' key goes only to an authenticated caller: whoever holds the stream reads the mutation."""
        s = self.gw.settings.auth
        m = ep.HeaderMutation()
        if s.worker_api_key is not None and self.trusted:
            m.set_headers.extend(proto.set_headers({"authorization": f"Bearer {s.worker_api_key.get_secret_value()}"}))
            if s.enabled:
                m.remove_headers.append("x-api-key")
        elif s.enabled or s.worker_api_key is not None:
            # Untrusted caller with a workers' key: no credential at all, rather than the client's (a
            # worker that checks keys refuses the request; Envoy's own route may add one).
            m.remove_headers.extend(["authorization", "x-api-key"])
        return m

    async def _json(self) -> dict[str, Any]:
        # As the HTTP front parses: a large body in a thread (up to max_body_bytes of messages is half a
        # second of parsing that would otherwise hold every other stream and request up).
        return await parse_object(bytes(self.body), self.gw.settings.hostile.json_limits)

    async def _route(self, p: Prepared) -> str:
        gw = self.gw
        router = gw.router
        plan = await router.plan(p)
        fleet = gw.pool.snapshot(p.model)
        barred = outside(self.subset, (gw.pool.get(w.id).config for w in fleet.workers))
        d = router.pick(p, plan, set(barred), front="epp", attempt=1)
        if d is None:
            raise ServiceUnavailable(f"No healthy worker for model `{p.model}`"
                                     + (" among the endpoints Envoy allowed." if self.subset is not None else "."),
                                     code="no_healthy_worker", headers={"retry-after": str(gw.settings.retry_after_s)})
        w = d.worker
        self.lc = lc = router.lifecycle(p, plan, trust="claim")  # the status is Envoy's claim (epp/trust.py)
        cmds = lc.dispatched(d, router.node(w), gw.clock.now())
        gw.relay.execute(lc.current, cmds)
        return ",".join([endpoint_of(gw.pool.get(w).config), *self._fallbacks(d, fleet.healthy(), barred)])

    def _fallbacks(self, d: Decision, healthy: Any, barred: set[WorkerId]) -> list[str]:
        """The next best workers for Envoy's retries: by the policy's score, else by load."""
        n = self.gw.settings.epp_fallbacks
        rest = [w for w in healthy if w.id != d.worker and w.id not in barred]
        rest.sort(key=lambda w: (d.scores.get(w.id, float("inf")), w.in_flight, w.id))
        return [endpoint_of(self.gw.pool.get(w.id).config) for w in rest[:n]]

    async def _fallback(self) -> str:
        """A request kvgate does not route by its prefix (not a completion, or no body): the least loaded
        healthy worker Envoy allows, of the body's model when it names one kvgate serves."""
        model = None
        try:
            body = await parse_object(bytes(self.body), self.gw.settings.hostile.json_limits) if self.body else None
            if isinstance(body, dict) and isinstance(body.get("model"), str) and self.gw.pool.serves(body["model"]):
                model = body["model"]
        except BadRequest:  # not a JSON object: no model to prefer
            pass
        workers = [w for w in self.gw.pool.all() if w.healthy and (model is None or w.config.model == model)]
        barred = outside(self.subset, (w.config for w in workers))
        workers = sorted((w for w in workers if w.id not in barred), key=lambda w: (w.in_flight, w.id))
        if not workers:
            where = " among the endpoints Envoy allowed." if self.subset is not None else "."
            raise ServiceUnavailable("No healthy worker" + where, code="no_healthy_worker",
                                     headers={"retry-after": str(self.gw.settings.retry_after_s)})
        return endpoint_of(workers[0].config)

    def _forward(self, endpoints: str, body: bytes, changed: bool) -> list[ep.ProcessingResponse]:
        headers = {**self.trace_headers, proto.DESTINATION: endpoints}
        if changed:
            headers["content-length"] = str(len(body))
        mutation = self._credentials()
        mutation.set_headers.extend(proto.set_headers(headers))
        common = ep.CommonResponse(header_mutation=mutation, clear_route_cache=True)
        md = proto.destination_metadata(endpoints)
        if self.headers_answered:  # BUFFERED: the pick rides on the body response
            if changed:
                common.body_mutation.body = body
            return [ep.ProcessingResponse(request_body=ep.BodyResponse(response=common), dynamic_metadata=md)]
        self.headers_answered = True
        out = [ep.ProcessingResponse(request_headers=ep.HeadersResponse(response=common), dynamic_metadata=md)]
        if self.body_seen:  # FULL_DUPLEX_STREAMED: the body goes back in chunks (Envoy forwards only those)
            out += [ep.ProcessingResponse(request_body=ep.BodyResponse(response=c))
                    for c in proto.streamed(body, end_of_stream=self.body_eos)]
        return out

    def _error(self, exc: ApiError) -> list[ep.ProcessingResponse]:
        self.done = True
        self.m.count_request(self.kind or "other", exc.status)
        headers = {"content-type": "application/json", **exc.headers}
        return [proto.immediate(exc.status, json.dumps(exc.body()).encode(), headers,
                                f"kvgate_{exc.code or exc.status}")]

    # -- response ------------------------------------------------------------------------------
    def _response_headers(self, req: ep.ProcessingRequest) -> list[ep.ProcessingResponse]:
        h = proto.headers_of(req.response_headers.headers)
        status = proto.unsigned(h.get(":status", "0"))
        self.status = status if status is not None and status < 1000 else 0  # HTTP statuses have three digits
        self.sse = "text/event-stream" in h.get("content-type", "")
        ex = self.ex
        extra: dict[str, str] = {}
        if ex is not None:
            self._served(proto.served_of(req))
            extra = self.gw.relay.headers(self.ex) if self.ex is not None else {}
            self._status_seen()
            if self.sse and 200 <= self.status < 300 and self.lc is not None:  # as the proxy's stream starts
                self.gw.relay.execute(ex, self.lc.relaying(self.gw.clock.now()))
        out = [ep.ProcessingResponse(response_headers=ep.HeadersResponse(response=ep.CommonResponse(
            header_mutation=ep.HeaderMutation(set_headers=proto.set_headers(extra)))))]
        if req.response_headers.end_of_stream:
            self._release_unrecorded()
        return out

    def _served(self, served: str | None) -> None:
        """Envoy reports which endpoint served (a fallback when the pick failed before it had the request):
        the slot, the in-flight prompt and the turn's record move there."""
        ex = self.ex
        if ex is None or served is None or served == endpoint_of(self.gw.pool.get(ex.decision.worker).config):
            return
        w = next((w for w in self.gw.pool.all() if endpoint_of(w.config) == served), None)
        if w is None or self.lc is None:
            return
        self.gw.relay.execute(ex, self.lc.moved(w.id, self.gw.router.node(w.id), self.gw.clock.now()))

    def _status_seen(self) -> None:
        """The status is the stream's claim: it settles this request (recorded or not), never the worker's
        health for everyone. kvgate_upstream_failures counts what kvgate's own connections saw, so the
        claim is counted apart; a claimed 502/503/504 asks for an early active check (kvgate/epp/probe.py)."""
        ex, lc = self.ex, self.lc
        assert ex is not None and lc is not None
        w = ex.decision.worker
        if self.epp_metrics is not None:
            cls = f"{self.status // 100}xx" if 100 <= self.status < 600 else "other"
            self.epp_metrics.reported.labels(w, cls).inc()
        verdict = lc.answered(self.status, self.gw.clock.now())  # the proxy's table, trust="claim"
        self.gw.relay.execute(ex, verdict.commands, self.probe.request if self.probe is not None else None)

    async def _response_body(self, b: ep.HttpBody) -> list[ep.ProcessingResponse]:
        eos = b.end_of_stream
        if self.ex is None or self.passthrough or not 200 <= self.status < 300 \
                or (self.resp_mode == proto.BUFFERED and not eos):
            # Nothing to read on the way (not routed by kvgate, an error answer, past the cap, a body Envoy
            # cut at its buffer limit): passed on unchanged.
            self.passthrough = True
            if eos:
                self._release_unrecorded()
            return self._body_out(b.body, eos, changed=False)
        if self.sse:
            chunk = self._events(self.splitter.feed(b.body))
            if not eos:
                return self._body_out(chunk, False, changed=True) if chunk else []
            self.held += chunk
            return await self._finish_sse(final=True)
        self.held += b.body
        if len(self.held) > MAX_RESPONSE_BYTES:
            data, self.held = bytes(self.held), bytearray()
            self.passthrough = True
            self._release_unrecorded()
            return self._body_out(data, eos, changed=False)
        return await self._finish_json() if eos else []

    def _events(self, events: list[SseEvent]) -> bytes:
        assert self.lc is not None
        return self.gw.relay.events(self.lc, events)

    def _end(self, outcome: Outcome) -> None:
        """The exchange ends with no turn to record (the client left, an answer not read)."""
        assert self.lc is not None
        self.gw.relay.execute(self.lc.current, self.lc.ended(outcome, self.status, self.gw.clock.now()))

    async def _finish_sse(self, final: bool) -> list[ep.ProcessingResponse]:
        """The end of an SSE response: the last events, the turn recorded, then the last chunk."""
        ex = self.ex
        if ex is None or self.finished:
            return []
        self.held += self._events(self.splitter.flush())
        self.finished = True
        assert self.lc is not None  # the same end as the proxy's (gateway/lifecycle.py)
        await self.gw.relay.run(ex, self.lc.ended("done", self.status, self.gw.clock.now()))
        data, self.held = bytes(self.held), bytearray()
        return self._body_out(data, final, changed=True)

    async def _finish_json(self) -> list[ep.ProcessingResponse]:
        assert self.lc is not None
        self.finished = True
        # As in proxy mode: the exchange ends (its slot first, with its service time), the turn recorded,
        # the request counted and its trace finished.
        data = await self.gw.relay.unary(self.lc, bytes(self.held), self.status)
        self.held = bytearray()
        return self._body_out(data, True, changed=True)

    def _release_unrecorded(self) -> None:
        """The response ended without a turn to record (an error status, no body, past the cap)."""
        ex = self.ex
        if ex is None or self.finished:
            return
        self.finished = True
        self._end("unread")

    def _body_out(self, data: bytes, end_of_stream: bool, changed: bool) -> list[ep.ProcessingResponse]:
        if self.resp_mode == proto.BUFFERED:
            common = ep.CommonResponse()
            if changed:
                common.body_mutation.body = data
                common.header_mutation.set_headers.extend(proto.set_headers({"content-length": str(len(data))}))
            return [ep.ProcessingResponse(response_body=ep.BodyResponse(response=common))]
        return [ep.ProcessingResponse(response_body=ep.BodyResponse(response=c))
                for c in proto.streamed(data, end_of_stream)]
