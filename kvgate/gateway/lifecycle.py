"""How one exchange with a worker ends, whichever front carried it.

The proxy relays the worker's answer itself; the endpoint picker sees it as Envoy's ext_proc response
phases. Both end the same exchange, and every duty of that end — the worker's slot back with its service
time, the turn recorded, the completion charged, the request counted, the trace finished, the request
log written — is decided here once, then executed by ``Relay.end`` for both. Before, each front had its
own copy and the picker's had diverged: no service time (the cost model's slot wait stayed 0 behind
Envoy), no request-log line for its streams, no trace.

Pure: the outcome, the status and the clock's readings in; what to do out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvgate.gateway.telemetry import STATUS_CLIENT_CLOSED, STATUS_STREAM_BROKEN

Outcome = Literal["done", "unread", "cancelled", "failed"]
"""``done``: the answer was read whole; ``unread``: it ended without kvgate reading it (an error status,
no body, a body past what kvgate reads); ``cancelled``: the client left; ``failed``: the worker's stream
broke."""


@dataclass(frozen=True, slots=True)
class Ending:
    held_s: float | None
    """How long the request held its worker: known only for an answer read whole (the average prices the
    wait for a slot on a full worker)."""
    record: bool
    """A turn to record (and its completion to charge): a whole 2xx answer."""
    status: str
    """The request's status as counted and traced (499: the client left; 502: the stream broke)."""
    disconnected: bool
    logged: bool
    """A line in the request log ``kvgate tune`` replays: every exchange a worker answered 2xx."""


def ending(outcome: Outcome, http_status: int, started: float, now: float) -> Ending:
    done = outcome == "done"
    status = {"done": str(http_status), "unread": str(http_status) if http_status else "other",
              "cancelled": STATUS_CLIENT_CLOSED, "failed": STATUS_STREAM_BROKEN}[outcome]
    ok = 200 <= http_status < 300
    return Ending(held_s=now - started if done else None, record=done and ok, status=status,
                  disconnected=outcome == "cancelled", logged=ok and outcome != "unread")
