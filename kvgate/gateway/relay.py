"""The worker's answer on its way back: SSE events relayed as soon as each is complete, with the time to
first token, the usage and (for a chat turn kvgate keeps) the reply read on the way; then the outcome is
recorded. Response headers say where the request went and why.

``Relay`` is also the executor of the exchange lifecycle's commands (gateway/lifecycle.py) for both
fronts, the proxy and the endpoint picker: the worker pool, the prefix view, the record, and the
observers (gateway/observers.py) told at the lifecycle's hooks."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from typing import TYPE_CHECKING, assert_never

from kvgate.clock import Clock
from kvgate.gateway.exchange import Exchange
from kvgate.gateway.lifecycle import (
    Acquire,
    Cmd,
    CountFailure,
    Ended,
    ExchangeLifecycle,
    ExchangeObserver,
    FirstToken,
    InFlight,
    Learned,
    MarkFailed,
    Outcome,
    Probe,
    Record,
    Relayed,
    Relaying,
    Release,
)
from kvgate.gateway.observers import MetricsObserver, RequestLogObserver, TraceObserver
from kvgate.gateway.record import Recorder
from kvgate.gateway.requestlog import RequestLog
from kvgate.gateway.sse import SseEvent, SseSplitter, error_event
from kvgate.gateway.telemetry import GatewayMetrics
from kvgate.gateway.upstream import Lost, UpstreamResponse
from kvgate.gateway.workers import WorkerPool
from kvgate.router.types import WorkerId

if TYPE_CHECKING:
    from kvgate.gateway.route import Router


class Relay:
    def __init__(self, pool: WorkerPool, clock: Clock, metrics: GatewayMetrics, recorder: Recorder,
                 policy_name: str, requests: RequestLog | None = None, router: Router | None = None,
                 observers: Sequence[ExchangeObserver] | None = None) -> None:
        self.requests = requests or RequestLog()
        self.router = router
        """The in-flight prompt and the cache view learn from the exchange (None: a relay without routing)."""
        self.observers: list[ExchangeObserver] = list(observers) if observers is not None else [
            MetricsObserver(metrics), TraceObserver(), RequestLogObserver(self.requests)]
        """Told of every exchange at the lifecycle's hooks: the per-request metrics, spans and request log."""
        self.pool = pool
        self.clock = clock
        self.metrics = metrics
        self.recorder = recorder
        self.policy_name = policy_name

    def headers(self, ex: Exchange) -> dict[str, str]:
        p, d = ex.prepared, ex.decision
        out = {
            "x-kvgate-worker": d.worker,
            "x-kvgate-route-reason": f"{self.policy_name}:{d.reason}",
            "x-kvgate-route-tier": d.tier,
            "x-kvgate-conversation-id": p.ident.conversation_id,
            "x-kvgate-conversation-source": p.ident.source,
        }
        if p.show_cache:
            out["x-kvgate-expected-cached-tokens"] = str(d.expected_cached_tokens)
        if p.ticket is not None:
            out.update(p.ticket.headers())
        turn = p.turn
        if turn is not None:
            c = turn.canonical
            out["x-kvgate-history"] = (f"policy={turn.protocol.policy}; restored={len(c.restored)}; "
                                       f"reasoning_changed={len(c.reasoning_changed)}")
            if turn.loss is not None and p.show_cache:
                out["x-kvgate-prefix-reuse"] = (f"cached={d.expected_cached_tokens}; expected={turn.loss.best}; "
                                                f"lost={turn.loss.lost}; cause={turn.loss.cause or 'none'}")
        return out

    # -- the lifecycle's commands, executed (gateway/lifecycle.py) --------------------------------------
    def execute(self, ex: Exchange, cmds: Iterable[Cmd], probe: Callable[[WorkerId], None] | None = None) -> None:
        """Run ``cmds`` for ``ex`` where nothing may be awaited (a turn to record needs ``run``)."""
        for c in cmds:
            self._one(ex, c, probe)

    async def run(self, ex: Exchange, cmds: Iterable[Cmd], probe: Callable[[WorkerId], None] | None = None) -> None:
        for c in cmds:
            if isinstance(c, Record):
                charge_completion(ex)
                await self.recorder.record(ex)
            else:
                self._one(ex, c, probe)

    def _one(self, ex: Exchange, c: Cmd, probe: Callable[[WorkerId], None] | None) -> None:
        match c:
            case Acquire():
                self.pool.acquire(c.worker, c.prefill_tokens)
            case InFlight():
                if self.router is not None:
                    self.router.dispatched(ex.prepared, c.worker)
            case Learned():
                if self.router is not None:
                    self.router.accepted(ex.prepared, c.worker)
            case FirstToken():
                for o in self.observers:
                    o.first_token(ex, c.at)
                self.pool.first_token(c.worker, c.prefill_tokens, c.context_tokens)
            case Release():
                self.pool.release(c.worker, c.prefill_tokens, c.context_tokens, c.got_first_token, c.held_s)
            case CountFailure():
                self.metrics.upstream_failures.labels(c.worker, c.kind).inc()
            case MarkFailed():
                self.metrics.upstream_failures.labels(c.worker, c.kind).inc()
                self.pool.mark_failed(c.worker, c.error, c.kind)
            case Probe():
                if probe is not None:
                    probe(c.worker)
            case Relaying():
                for o in self.observers:
                    o.relaying(ex)
            case Relayed():
                for o in self.observers:
                    o.relayed(ex, c.outcome, c.streamed)
            case Ended():
                for o in self.observers:
                    o.ended(ex, c.outcome, c.ending)
            case Record():
                raise AssertionError("a turn to record needs run()")
            case _:
                assert_never(c)

    def attempted(self, ex: Exchange, outcome: object) -> None:
        """An attempt of the proxy's returned (a response, or why its worker failed)."""
        for o in self.observers:
            o.attempted(ex, outcome)

    # -- the answer ------------------------------------------------------------------------------------
    async def unary(self, lc: ExchangeLifecycle, content: bytes, http_status: int, counted: bool = True) -> bytes:
        """A non-streamed answer read whole: read (usage, id, reply), the exchange ended and its turn
        recorded; returns the body the client gets (without the token ids kvgate asked for).
        ``counted=False``: the front counts the request and finishes its trace (the proxy)."""
        ex = lc.current
        self.execute(ex, lc.relaying(self.clock.now()))
        content = lc.body(content, self.clock.now())
        await self.run(ex, lc.ended("done", http_status, self.clock.now(), streamed=False, counted=counted))
        return content

    async def stream(self, lc: ExchangeLifecycle, upstream: UpstreamResponse, first: bytes, it: AsyncIterator[bytes]
                     ) -> AsyncIterator[bytes]:
        ex = lc.current
        self.execute(ex, lc.relaying(self.clock.now()))
        splitter = SseSplitter()
        outcome: Outcome = "cancelled"  # until the stream ends or breaks: the client went away
        try:
            chunk: bytes | None = first
            while chunk is not None:
                # The events that arrived together leave together: one write to the client's socket, not
                # one per event (over loopback a send costs about what relaying the event does), and no
                # event waits for anything that had not arrived.
                out = self.events(lc, splitter.feed(chunk))
                if out:
                    yield out
                try:
                    chunk = await it.__anext__()
                except StopAsyncIteration:
                    chunk = None
            out = self.events(lc, splitter.flush())
            if out:
                yield out
            outcome = "done"
        except Lost as exc:
            outcome = "failed"
            w = ex.decision.worker
            self.execute(ex, lc.lost(str(exc), "stream_broken", self.clock.now()).commands)
            yield error_event(f"worker {w} failed mid-stream: {exc.kind}")
        finally:
            await upstream.close()
            await self.run(ex, lc.ended(outcome, upstream.status, self.clock.now()))

    def events(self, lc: ExchangeLifecycle, events: list[SseEvent]) -> bytes:
        """SSE events read on the way (``ExchangeLifecycle.event``): the bytes to pass on."""
        if len(events) == 1:
            return self._event(lc, events[0]) or b""
        return b"".join(out for ev in events if (out := self._event(lc, ev)) is not None)

    def _event(self, lc: ExchangeLifecycle, ev: SseEvent) -> bytes | None:
        out, first = lc.event(ev, self.clock.now())
        if first is not None:
            self._one(lc.current, first, None)
        return out


def charge_completion(ex: Exchange) -> None:
    """The tenant's tokens per minute count the completion too, now that the usage says how long it was."""
    t = ex.prepared.ticket
    if t is not None and ex.usage is not None:
        t.completed(ex.usage.completion_tokens)
