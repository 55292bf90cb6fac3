"""What is observed of an exchange, whichever front carried it (gateway/lifecycle.py's hooks): the
per-request metrics, the request's spans, the request log. ``Relay`` tells these at the hooks the
lifecycle's commands name, so the proxy and the endpoint picker get them alike, by construction."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvgate.gateway.exchange import Exchange, Prepared
from kvgate.gateway.lifecycle import Ending, Observer, Outcome
from kvgate.gateway.requestlog import RequestLog
from kvgate.gateway.telemetry import GatewayMetrics
from kvgate.router.types import Decision

if TYPE_CHECKING:
    from kvgate.gateway.route import Plan


class MetricsObserver(Observer):
    """The decisions by policy and reason; TTFT and output timing from the first token; the request counted
    (and a client that left) at the end."""

    def __init__(self, metrics: GatewayMetrics) -> None:
        self.metrics = metrics

    def routed(self, p: Prepared, plan: Plan, decision: Decision | None, policy: str) -> None:
        if decision is not None:
            self.metrics.route_decisions.labels(policy, decision.reason, decision.tier,
                                                str(decision.bounded).lower()).inc()

    def first_token(self, ex: Exchange, at: float) -> None:
        p = ex.prepared
        assert ex.ttft_s is not None
        self.metrics.observe_ttft(p.model, p.ident.tenant, ex.ttft_s)
        ex.decode = self.metrics.decode_timing(p.model, at)

    def ended(self, ex: Exchange, outcome: Outcome, e: Ending) -> None:
        if not e.counted:
            return
        if e.disconnected:
            self.metrics.client_disconnects.inc()
        self.metrics.count_request(ex.prepared.endpoint, e.status)


class TraceObserver(Observer):
    """The request's spans (``Prepared.trace``: ``OFF`` when not traced)."""

    def routed(self, p: Prepared, plan: Plan, decision: Decision | None, policy: str) -> None:
        p.trace.routed(p, plan, decision, policy)

    def attempted(self, ex: Exchange, outcome: object) -> None:
        ex.prepared.trace.attempted(ex, outcome)

    def relaying(self, ex: Exchange) -> None:
        ex.prepared.trace.mark("relay")

    def first_token(self, ex: Exchange, at: float) -> None:
        ex.prepared.trace.first_token(ex)

    def relayed(self, ex: Exchange, outcome: Outcome, streamed: bool) -> None:
        if streamed:
            ex.prepared.trace.streamed(ex, outcome)
        else:
            ex.prepared.trace.answered(ex)

    def ended(self, ex: Exchange, outcome: Outcome, e: Ending) -> None:
        if e.counted:
            ex.prepared.trace.finish(e.status)


class RequestLogObserver(Observer):
    """One line per exchange a worker answered 2xx, for ``kvgate tune``."""

    def __init__(self, requests: RequestLog) -> None:
        self.requests = requests

    def ended(self, ex: Exchange, outcome: Outcome, e: Ending) -> None:
        if e.logged:
            self.requests.write(ex, outcome)
