"""The ``envoy.service.ext_proc.v3.ExternalProcessor`` service: one ``Process`` stream per HTTP request."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import grpc
from prometheus_client import Counter, Histogram

from kvgate.epp.probe import EarlyProbe
from kvgate.epp.stream import EppStream, OutOfOrder, Unsupported
from kvgate.epp.trust import Refused, authenticate
from kvgate.grpc.gen.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from kvgate.grpc.gen.envoy.service.ext_proc.v3 import external_processor_pb2_grpc as epgrpc

if TYPE_CHECKING:
    from kvgate.gateway.parts import Parts

log = logging.getLogger(__name__)


class EppMetrics:
    def __init__(self, gw: Parts) -> None:
        r = gw.metrics.registry
        self.decision = Histogram("kvgate_epp_decision_seconds", "Endpoint picker: from the end of a request's "
                                  "body to the pick (prepare, plan, pick)", registry=r,
                                  buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0))
        self.streams = Counter("kvgate_epp_streams", "Endpoint picker ext_proc streams by how they ended: "
                               "completed, aborted (ended before the response did), rejected (an immediate "
                               "response), refused (an unsupported filter configuration, or a request "
                               "phase after the end of the request), observability "
                               "(the filter runs in observability mode), unauthenticated (the caller "
                               "failed epp_auth)", ["outcome"], registry=r)
        self.reported = Counter("kvgate_epp_reported_status", "Response statuses the ext_proc caller reported "
                                "for a pick, by worker and status class: the stream's claim, not evidence of "
                                "the worker's health (a reported 502/503/504 only asks for an early active "
                                "check)", ["worker", "status"], registry=r)


class ExtProcService(epgrpc.ExternalProcessorServicer):
    def __init__(self, gw: Parts) -> None:
        self.gw = gw
        self.metrics = EppMetrics(gw)
        self.probe = EarlyProbe(gw)
        trust = gw.settings.epp_auth
        if not trust.authenticates and not trust.allow_unauthenticated:
            log.warning("endpoint picker: any caller that reaches the ext_proc port is served (set epp_auth.tokens "
                        "and/or epp_auth.client_ca_file, or epp_auth.allow_unauthenticated: true; docs/epp.md)")

    async def Process(self, request_iterator: AsyncIterator[ep.ProcessingRequest],
                      context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[ep.ProcessingResponse]:
        try:
            trusted = authenticate(self.gw.settings.epp_auth, context.invocation_metadata() or (),
                                   context.auth_context())
        except Refused as exc:
            self.metrics.streams.labels("unauthenticated").inc()
            await context.abort(exc.code, str(exc))
        stream = EppStream(self.gw, self.metrics, trusted=trusted, probe=self.probe)
        outcome = "aborted"
        try:
            async for req in request_iterator:
                if req.observability_mode:
                    # Envoy ignores answers in this mode: the picker cannot pick. Closing the stream cleanly
                    # tells it no more messages are needed.
                    outcome = "observability"
                    return
                try:
                    out = await stream.handle(req)
                except Unsupported as exc:
                    outcome = "refused"
                    await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
                except OutOfOrder as exc:
                    outcome = "refused"
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
                for resp in out:
                    yield resp
                if stream.done:
                    outcome = "rejected"
                    return
            outcome = "completed" if stream.finished or stream.ex is None else "aborted"
        finally:
            if outcome == "aborted" and stream.ex is not None and not stream.finished:
                log.debug("ext_proc stream ended before its response: %s", stream.ex.prepared.ident.conversation_id)
            stream.close()
            self.metrics.streams.labels(outcome).inc()
