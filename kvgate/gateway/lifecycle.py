"""One exchange with a worker, whichever front carries it: a sans-IO state machine, events in, commands out.

The proxy sends the request and relays the answer itself (``send.py``, ``relay.py``); the endpoint picker
sees the same exchange as Envoy's ext_proc phases (``epp/stream.py``). Both drive one
``ExchangeLifecycle`` and execute what it returns (``Relay.execute`` / ``Relay.run``), so every rule of
the exchange is written once: the worker's slot taken and given back (with its service time for an
answer read whole), the in-flight prompt, the verdict on the worker's status (accept, retry on another
worker, fail), the first token, Envoy's fallback endpoint taking over, and every duty of the end — the
turn recorded, the completion charged, the request counted, the trace finished, the request log
written. Before, each front had its own copy and the picker's had diverged: no service time (the cost
model's slot wait stayed 0 behind Envoy), no request-log line for its streams, no trace.

Pure: no I/O, no asyncio, no metrics or trace object; time is an argument. What is observed of the
exchange (metrics, spans, the request log) is told to ``ExchangeObserver``s by whoever executes the
commands (``gateway/observers.py``), at the hooks the commands name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

import orjson

from kvgate import safejson
from kvgate.gateway.engine_ids import EngineIds
from kvgate.gateway.exchange import Exchange, Prepared, Usage
from kvgate.gateway.sse import SseEvent
from kvgate.gateway.telemetry import STATUS_CLIENT_CLOSED, STATUS_STREAM_BROKEN
from kvgate.router.types import Decision, WorkerId

if TYPE_CHECKING:
    from kvgate.gateway.route import Plan

Outcome = Literal["done", "unread", "cancelled", "failed"]
"""``done``: the answer was read whole; ``unread``: it ended without kvgate reading it (an error status,
no body, a body past what kvgate reads); ``cancelled``: the client left; ``failed``: the worker's stream
broke."""

Trust = Literal["own", "claim"]
"""Who saw the worker's status. ``own``: kvgate's own connection (the proxy): a 502/503/504 counts against
the worker's health, and the request may go to another worker (kvgate retries). ``claim``: the caller says
so (the endpoint picker, told by Envoy, kvgate/epp/trust.py and docs/epp.md): the status settles this
request, never the worker's health for everyone; a claimed 502/503/504 asks for an early active check
instead (kvgate/epp/probe.py), and the retry elsewhere is Envoy's (the fallback endpoints)."""

RETRIED_ANSWERS = 2
"""A 502/503/504 is retried on one other worker at most: it may come from a proxy in front of an engine
the request itself killed, and a second one says the request, not the worker, is the likelier cause."""


# -- commands: what the executor does -------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Acquire:
    """The worker's slot (and the prompt's pending prefill there) is taken."""

    worker: WorkerId
    prefill_tokens: int


@dataclass(frozen=True, slots=True)
class InFlight:
    """The prompt counts as in flight on the worker (its blocks are likely to be there soon)."""

    worker: WorkerId


@dataclass(frozen=True, slots=True)
class Learned:
    """The worker accepted the request: kvgate's view of its cache now includes the prompt."""

    worker: WorkerId


@dataclass(frozen=True, slots=True)
class FirstToken:
    """The first output reached kvgate: the request moves from prefill to decode on its worker."""

    worker: WorkerId
    prefill_tokens: int
    context_tokens: int
    at: float


@dataclass(frozen=True, slots=True)
class Release:
    worker: WorkerId
    prefill_tokens: int
    context_tokens: int = 0
    got_first_token: bool = False
    held_s: float | None = None
    """How long the request held its worker: known only for an answer read whole (its average prices the
    wait for a slot on a full worker)."""


@dataclass(frozen=True, slots=True)
class CountFailure:
    """A failure seen on kvgate's own connection to the worker (``kvgate_upstream_failures``)."""

    worker: WorkerId
    kind: str


@dataclass(frozen=True, slots=True)
class MarkFailed:
    """``CountFailure``, and the worker's passive health check counts it."""

    worker: WorkerId
    error: str
    kind: str


@dataclass(frozen=True, slots=True)
class Probe:
    """A claimed 502/503/504: an early active check of the worker (kvgate/epp/probe.py)."""

    worker: WorkerId


@dataclass(frozen=True, slots=True)
class Relaying:
    """The accepted answer starts coming back (hook ``relaying``)."""


@dataclass(frozen=True, slots=True)
class Relayed:
    """The worker is done with the answer (hook ``relayed``): streamed, or read whole."""

    outcome: Outcome
    streamed: bool


@dataclass(frozen=True, slots=True)
class Record:
    """The turn is recorded and its completion charged to the tenant (awaited: the record's store write)."""


@dataclass(frozen=True, slots=True)
class Ended:
    """The exchange is over (hook ``ended``)."""

    outcome: Outcome
    ending: Ending


Cmd = Acquire | InFlight | Learned | FirstToken | Release | CountFailure | MarkFailed | Probe | Relaying | Relayed \
    | Record | Ended


# -- verdicts on the worker's answer ------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Accepted:
    """The worker took the request: its answer is relayed."""

    commands: tuple[Cmd, ...]


@dataclass(frozen=True, slots=True)
class RetryElsewhere:
    """The worker never had the request (or did not take it): another worker may (``answered``: it answered
    a status, which counts toward ``RETRIED_ANSWERS``)."""

    reason: str
    answered: bool
    commands: tuple[Cmd, ...]


@dataclass(frozen=True, slots=True)
class Failed:
    """The request failed on this worker and goes to no other. ``answer``: ``worker``, the worker's own
    answer goes back (it judged the request: a 4xx; a claimed status of the picker); ``request_failed``,
    the worker took the request and failed on it (a 500: a retry would hand it to every worker in turn);
    ``lost``, the worker had it and was lost before answering."""

    answer: Literal["worker", "request_failed", "lost"]
    commands: tuple[Cmd, ...]


Verdict = Accepted | RetryElsewhere | Failed


# -- the end -----------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Ending:
    held_s: float | None
    """How long the request held its worker: known only for an answer read whole."""
    record: bool
    """A turn to record (and its completion to charge): a whole 2xx answer."""
    status: str
    """The request's status as counted and traced (499: the client left; 502: the stream broke)."""
    disconnected: bool
    logged: bool
    """A line in the request log ``kvgate tune`` replays: every exchange a worker answered 2xx."""
    counted: bool = True
    """The request is counted and its trace finished at this end (False: by the front that answers it,
    the proxy's unary answers, counted with every other answer the proxy makes)."""


def ending(outcome: Outcome, http_status: int, started: float, now: float, counted: bool = True) -> Ending:
    done = outcome == "done"
    status = {"done": str(http_status), "unread": str(http_status) if http_status else "other",
              "cancelled": STATUS_CLIENT_CLOSED, "failed": STATUS_STREAM_BROKEN}[outcome]
    ok = 200 <= http_status < 300
    return Ending(held_s=now - started if done else None, record=done and ok, status=status,
                  disconnected=outcome == "cancelled", logged=ok and outcome != "unread", counted=counted)


# -- observers ---------------------------------------------------------------------------------------------
class ExchangeObserver(Protocol):
    """Told of an exchange at its hooks, by the executor of the lifecycle's commands (and of the routing
    decisions by ``Router.pick``), for every front. Must not block (it runs on the request path)."""

    def routed(self, p: Prepared, plan: Plan, decision: Decision | None, policy: str) -> None:
        """A routing decision for a real request (one per attempt; None: no eligible worker)."""

    def attempted(self, ex: Exchange, outcome: object) -> None:
        """An attempt returned (the proxy): a response, or why its worker failed (a string)."""

    def relaying(self, ex: Exchange) -> None:
        """The accepted answer starts coming back (a stream's first bytes, a body read whole)."""

    def first_token(self, ex: Exchange, at: float) -> None:
        """The first output reached kvgate at ``at`` (``ex.ttft_s`` is set)."""

    def relayed(self, ex: Exchange, outcome: Outcome, streamed: bool) -> None:
        """The worker is done with the answer, before the turn is recorded."""

    def ended(self, ex: Exchange, outcome: Outcome, e: Ending) -> None:
        """The exchange is over, its turn recorded if it had one."""


class Observer:
    """An ``ExchangeObserver`` that ignores every hook: subclasses override the ones they need."""

    def routed(self, p: Prepared, plan: Plan, decision: Decision | None, policy: str) -> None:
        pass

    def attempted(self, ex: Exchange, outcome: object) -> None:
        pass

    def relaying(self, ex: Exchange) -> None:
        pass

    def first_token(self, ex: Exchange, at: float) -> None:
        pass

    def relayed(self, ex: Exchange, outcome: Outcome, streamed: bool) -> None:
        pass

    def ended(self, ex: Exchange, outcome: Outcome, e: Ending) -> None:
        pass


# -- the lifecycle -----------------------------------------------------------------------------------------
class ExchangeLifecycle:
    """One prepared request's exchange with the workers: its attempts (the proxy's retries), the one the
    worker accepted, how that one ended. ``plan`` is the routing plan's matched tokens (per worker) and
    block size, which the exchange reports."""

    __slots__ = ("_answered", "_ended", "_matched", "best_matched_tokens", "block_size", "ex", "prepared",
                 "tried", "trust")

    def __init__(self, prepared: Prepared, block_size: int, matched: dict[WorkerId, int] | None = None,
                 best_matched_tokens: int = 0, trust: Trust = "own") -> None:
        self.prepared = prepared
        self.block_size = block_size
        self._matched = matched or {}
        """Tokens of the prompt each worker is known to hold."""
        self.best_matched_tokens = best_matched_tokens
        self.trust = trust
        self.tried: set[WorkerId] = set()
        self.ex: Exchange | None = None
        self._answered = 0
        self._ended = False

    @property
    def exhausted(self) -> bool:
        """No further attempt: ``RETRIED_ANSWERS`` workers answered 502/503/504."""
        return self._answered >= RETRIED_ANSWERS

    @property
    def current(self) -> Exchange:
        """The attempt dispatched last (the one a worker accepted, once one did)."""
        assert self.ex is not None, "no attempt dispatched"
        return self.ex

    def dispatched(self, decision: Decision, node: str, now: float) -> list[Cmd]:
        """An attempt goes to ``decision.worker`` (on ``node``): its slot and the in-flight prompt."""
        w = decision.worker
        self.tried.add(w)
        self._ended = False
        self.ex = ex = Exchange(self.prepared, decision, now, node, self.block_size, self._matched.get(w, 0),
                                self.best_matched_tokens)
        return [Acquire(w, ex.prefill_tokens), InFlight(w)]

    def answered(self, status: int, now: float, detail: str = "") -> Verdict:
        """The worker's status (``detail``: the start of an error answer's body): the one table.

        ===========  =================================  ==========================================
        status       own (the proxy)                    claim (the picker)
        ===========  =================================  ==========================================
        2xx, 3xx     accepted, the cache learns          accepted, the cache learns
        4xx          failed: the worker's answer         failed: the worker's answer
        502/503/504  retry elsewhere, health counts it   retry elsewhere (Envoy's), an early probe
        other 5xx    failed: request_failed, counted     failed: the worker's answer
        none (0)     (never: aiohttp has a status)       failed: the worker's answer
        ===========  =================================  ==========================================
        """
        w = self.current.decision.worker
        own = self.trust == "own"
        if status < 400 and (own or status >= 200):
            return Accepted((Learned(w),))
        if status < 500:
            return Failed("worker", ())
        if status in (502, 503, 504):
            self._answered += 1
            if own:
                return RetryElsewhere(f"worker {w} answered {status}", True,
                                      (MarkFailed(w, f"HTTP {status}: {detail}", "status_5xx"),))
            return RetryElsewhere(f"worker {w} answered {status}", True, (Probe(w),))
        # The worker took the request and failed on it (vLLM answers 500 when its engine dies of it): a
        # retry would hand the same request to every worker in turn. Not a health failure either: a
        # repeated bad request would otherwise empty the fleet.
        if own:
            return Failed("request_failed", (CountFailure(w, "status_500"),))
        return Failed("worker", ())

    def unsent(self, error: str, kind: str, now: float) -> RetryElsewhere:
        """The worker never had the request (a refused or timed-out connection, a failed write)."""
        w = self.current.decision.worker
        return RetryElsewhere(f"worker {w}: {error}", False, (MarkFailed(w, error, kind),))

    def lost(self, error: str, kind: str, now: float) -> Failed:
        """The worker had the request and was lost (before its first byte, or mid-stream: ``kind``)."""
        return Failed("lost", (MarkFailed(self.current.decision.worker, error, kind),))

    def abandoned(self, now: float) -> list[Cmd]:
        """An attempt over without an answer relayed (refused, failed, lost, the client gone before it was
        answered): only the slot goes back; the front answers the request."""
        ex = self.current
        if self._ended:
            return []
        self._ended = True
        return [Release(ex.decision.worker, ex.prefill_tokens)]

    def moved(self, worker: WorkerId, node: str, now: float) -> list[Cmd]:
        """Envoy reports that another endpoint served (a fallback, when the pick failed before it had the
        request): the slot, the in-flight prompt and the turn's record move there."""
        ex = self.current
        out: list[Cmd] = [Release(ex.decision.worker, ex.prefill_tokens)]
        self.tried.add(worker)
        ex.decision = Decision(worker, "fallback", 0, tier="none")
        ex.node, ex.chosen_matched_tokens = node, 0
        return [*out, Acquire(worker, ex.prefill_tokens), InFlight(worker)]

    def relaying(self, now: float) -> list[Cmd]:
        """The accepted answer starts coming back: a stream's first bytes, or a body read whole."""
        assert self.ex is not None, "no attempt dispatched"
        return [Relaying()]

    def event(self, ev: SseEvent, now: float) -> tuple[bytes | None, FirstToken | None]:
        """One SSE event read on the way (TTFT, usage, the reply): the bytes to pass on (None: drop it,
        usage the client did not ask for), and the first token when this event carries it."""
        ex = self.current
        # Most events are one token of output: decoding their JSON only to forward them unchanged costs
        # more CPU than the rest of the relay. Decode only what kvgate needs: the first output (TTFT),
        # usage, and the reply of a chat turn it keeps.
        turn = ex.prepared.turn
        if ex.ttft_s is not None and turn is None and b'"usage"' not in ev.raw:
            if ex.decode is not None and ev.payload is not None and not ev.done:
                ex.decode.token(now)  # a chunk without usage after the first output: output
            return ev.raw, None
        obj = ev.json()
        if obj is None:
            return ev.raw, None
        first: FirstToken | None = None
        usage = Usage.parse(obj.get("usage"))
        if usage is not None:
            ex.usage = usage
        choices = obj.get("choices")
        if ex.ttft_s is None and isinstance(choices, list) and any(_has_output(c) for c in choices):
            ex.ttft_s = now - ex.started
            first = FirstToken(ex.decision.worker, ex.prefill_tokens, ex.prepared.prompt.length, now)
        elif ex.decode is not None and isinstance(choices, list) and choices:
            ex.decode.token(now)
        if ex.response_id is None and isinstance(obj.get("id"), str):
            ex.response_id = obj["id"]
        if turn is not None and turn.strip_ids:
            ex.engine_ids = EngineIds.take(obj, ex.engine_ids)
            ev = SseEvent(b"data: " + safejson.dumps(obj) + b"\n\n", None)
        if turn is not None and isinstance(choices, list):
            for ch in choices:  # with n > 1 each choice streams in its own chunks: keep choice 0's
                if isinstance(ch, dict) and ch.get("index", 0) == 0:
                    delta = ch.get("delta")
                    if isinstance(delta, dict):
                        ex.reply.add_delta(delta)
                    if ch.get("finish_reason"):
                        ex.reply.complete = True
        hide = ex.prepared.hide_usage
        if hide and choices == [] and usage is not None:
            return None, first
        if hide and usage is not None:
            # continuous_usage_stats-style usage on a content chunk: strip just the field.
            obj.pop("usage", None)
            return b"data: " + safejson.dumps(obj) + b"\n\n", first
        return ev.raw, first

    def body(self, content: bytes, now: float) -> bytes:
        """A non-streamed answer read whole: usage, id and reply read from it; returns the body the client
        gets (without the token ids kvgate asked for)."""
        ex = self.current
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
        return content

    def ended(self, outcome: Outcome, http_status: int, now: float, *, streamed: bool = True,
              counted: bool = True) -> list[Cmd]:
        """The exchange is over: every duty of its end, in order (the slot first, so what the turn's end
        decides, a background prefill, sees the queue without this request). Once: a second end is none."""
        ex = self.current
        if self._ended:
            return []
        self._ended = True
        e = ending(outcome, http_status, ex.started, now, counted)
        out: list[Cmd] = [Release(ex.decision.worker, ex.prefill_tokens, ex.prepared.prompt.length,
                                  ex.ttft_s is not None, e.held_s), Relayed(outcome, streamed)]
        if e.record:
            out.append(Record())
        out.append(Ended(outcome, e))
        return out


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
