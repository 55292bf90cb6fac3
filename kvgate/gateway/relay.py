"""The worker's answer on its way back: SSE events relayed as soon as each is complete, with the time to
first token, the usage and (for a chat turn kvgate keeps) the reply read on the way; then the outcome is
recorded. Response headers say where the request went and why."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import orjson

from kvgate import safejson
from kvgate.clock import Clock
from kvgate.gateway.engine_ids import EngineIds
from kvgate.gateway.exchange import Exchange, Usage
from kvgate.gateway.lifecycle import Ending, Outcome, ending
from kvgate.gateway.record import Recorder
from kvgate.gateway.requestlog import RequestLog
from kvgate.gateway.sse import SseEvent, SseSplitter, error_event
from kvgate.gateway.telemetry import GatewayMetrics
from kvgate.gateway.upstream import Lost, UpstreamResponse
from kvgate.gateway.workers import WorkerPool


class Relay:
    def __init__(self, pool: WorkerPool, clock: Clock, metrics: GatewayMetrics, recorder: Recorder,
                 policy_name: str, requests: RequestLog | None = None) -> None:
        self.requests = requests or RequestLog()
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

    async def unary(self, ex: Exchange, content: bytes) -> bytes:
        """A non-streamed answer: read usage, id and reply from it, record; returns the body the client
        gets (without the token ids kvgate asked for)."""
        ex.prepared.trace.mark("relay")
        obj = _loads(content)
        ex.usage = Usage.parse(obj.get("usage")) if obj else None
        ex.response_id = obj.get("id") if obj and isinstance(obj.get("id"), str) else None
        choices = obj.get("choices") if obj else None
        if isinstance(choices, list) and choices and isinstance(choices[0], dict) \
                and isinstance(choices[0].get("message"), dict):
            ex.reply.set_message(choices[0]["message"])
        turn = ex.prepared.turn
        if obj is not None and turn is not None and turn.strip_ids:
            ex.engine_ids = EngineIds.take(obj)
            content = safejson.dumps(obj)
        ex.prepared.trace.answered(ex)
        charge_completion(ex)
        await self.recorder.record(ex)
        self.requests.write(ex, "done")
        return content

    async def stream(self, ex: Exchange, upstream: UpstreamResponse, first: bytes, it: AsyncIterator[bytes]
                     ) -> AsyncIterator[bytes]:
        ex.prepared.trace.mark("relay")
        splitter = SseSplitter()
        outcome: Outcome = "cancelled"  # until the stream ends or breaks: the client went away
        w = ex.decision.worker
        try:
            chunk: bytes | None = first
            while chunk is not None:
                # The events that arrived together leave together: one write to the client's socket, not
                # one per event (over loopback a send costs about what relaying the event does), and no
                # event waits for anything that had not arrived.
                out = self._inspect_all(ex, splitter.feed(chunk))
                if out:
                    yield out
                try:
                    chunk = await it.__anext__()
                except StopAsyncIteration:
                    chunk = None
            out = self._inspect_all(ex, splitter.flush())
            if out:
                yield out
            outcome = "done"
        except Lost as exc:
            outcome = "failed"
            self.metrics.upstream_failures.labels(w, "stream_broken").inc()
            self.pool.mark_failed(w, str(exc), "stream_broken")
            yield error_event(f"worker {w} failed mid-stream: {exc.kind}")
        finally:
            await upstream.close()
            await self.end(ex, outcome, upstream.status)

    async def end(self, ex: Exchange, outcome: Outcome, http_status: int) -> None:
        """The exchange is over: every duty of its end, for every front (gateway/lifecycle.py)."""
        e = self._release(ex, outcome, http_status)
        if e.record:
            charge_completion(ex)
            await self.recorder.record(ex)
        self._settle(ex, outcome, e)

    def end_unrecorded(self, ex: Exchange, outcome: Outcome, http_status: int) -> None:
        """``end`` for an exchange with no turn to record (the client left, an answer not read): callable
        where nothing may be awaited (the picker's stream closing)."""
        e = self._release(ex, outcome, http_status)
        assert not e.record, "a turn to record needs end()"
        self._settle(ex, outcome, e)

    def _release(self, ex: Exchange, outcome: Outcome, http_status: int) -> Ending:
        e = ending(outcome, http_status, ex.started, self.clock.now())
        self.pool.release(ex.decision.worker, ex.prefill_tokens, ex.prepared.prompt.length, ex.ttft_s is not None,
                          e.held_s)
        ex.prepared.trace.streamed(ex, outcome)
        return e

    def _settle(self, ex: Exchange, outcome: Outcome, e: Ending) -> None:
        if e.disconnected:
            self.metrics.client_disconnects.inc()
        self.metrics.count_request(ex.prepared.endpoint, e.status)
        ex.prepared.trace.finish(e.status)
        if e.logged:
            self.requests.write(ex, outcome)

    def event(self, ex: Exchange, ev: SseEvent) -> bytes | None:
        """One SSE event of ``ex``'s stream read on the way (TTFT, usage, the reply): the bytes to pass
        on, or None to drop it (usage the client did not ask for). For the endpoint picker, whose
        streams Envoy forwards."""
        return self._inspect(ex, ev)

    def _inspect_all(self, ex: Exchange, events: list[SseEvent]) -> bytes:
        if len(events) == 1:
            return self._inspect(ex, events[0]) or b""
        return b"".join(out for ev in events if (out := self._inspect(ex, ev)) is not None)

    def _inspect(self, ex: Exchange, ev: SseEvent) -> bytes | None:
        # Most events are one token of output: decoding their JSON only to forward them unchanged costs
        # more CPU than the rest of the relay. Decode only what kvgate needs: the first output (TTFT),
        # usage, and the reply of a chat turn it keeps.
        hide = ex.prepared.hide_usage
        if ex.ttft_s is not None and ex.prepared.turn is None and b'"usage"' not in ev.raw:
            if ex.decode is not None and ev.payload is not None and not ev.done:
                ex.decode.token(self.clock.now())  # a chunk without usage after the first output: output
            return ev.raw
        obj = ev.json()
        if obj is None:
            return ev.raw
        usage = Usage.parse(obj.get("usage"))
        if usage is not None:
            ex.usage = usage
        choices = obj.get("choices")
        if ex.ttft_s is None and isinstance(choices, list) and any(_has_output(c) for c in choices):
            now = self.clock.now()
            ex.ttft_s = now - ex.started
            self.metrics.observe_ttft(ex.prepared.model, ex.prepared.ident.tenant, ex.ttft_s)
            ex.prepared.trace.first_token(ex)
            ex.decode = self.metrics.decode_timing(ex.prepared.model, now)
            self.pool.first_token(ex.decision.worker, ex.prefill_tokens, ex.prepared.prompt.length)
        elif ex.decode is not None and isinstance(choices, list) and choices:
            ex.decode.token(self.clock.now())
        if ex.response_id is None and isinstance(obj.get("id"), str):
            ex.response_id = obj["id"]
        if ex.prepared.turn is not None and ex.prepared.turn.strip_ids:
            ex.engine_ids = EngineIds.take(obj, ex.engine_ids)
            ev = SseEvent(b"data: " + safejson.dumps(obj) + b"\n\n", None)
        if ex.prepared.turn is not None and isinstance(choices, list):
            for ch in choices:  # with n > 1 each choice streams in its own chunks: keep choice 0's
                if isinstance(ch, dict) and ch.get("index", 0) == 0:
                    delta = ch.get("delta")
                    if isinstance(delta, dict):
                        ex.reply.add_delta(delta)
                    if ch.get("finish_reason"):
                        ex.reply.complete = True
        if hide and choices == [] and usage is not None:
            return None
        if hide and usage is not None:
            # continuous_usage_stats-style usage on a content chunk: strip just the field.
            obj.pop("usage", None)
            return b"data: " + safejson.dumps(obj) + b"\n\n"
        return ev.raw


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
        obj = orjson.loads(content)
    except orjson.JSONDecodeError:
        try:  # what orjson refuses and the stdlib took (NaN): read as it always was
            obj = json.loads(content)
        except (ValueError, RecursionError):
            return None
    return obj if isinstance(obj, dict) else None


def charge_completion(ex: Exchange) -> None:
    """The tenant's tokens per minute count the completion too, now that the usage says how long it was."""
    t = ex.prepared.ticket
    if t is not None and ex.usage is not None:
        t.completed(ex.usage.completion_tokens)
