"""What a gateway knows of one worker's queue: only what it sent there and what came back.

One class for the gateway's worker pool (``gateway/workers.py``'s ``WorkerState``) and the virtual-time
fleets (``sim/fleetcore.py``'s ``Accounting``), so the simulator prices the very queue the gateway would:
a request is "pending" (its uncached tokens wait for prefill) from the moment it is sent until its first
token, then "decoding" until it ends. The lifecycle's ``Acquire``, ``FirstToken`` and ``Release`` commands
(``gateway/lifecycle.py``) name exactly these three steps.
"""

from __future__ import annotations

from dataclasses import dataclass

SERVICE_EWMA = 0.1
"""Weight of the newest request in a worker's average holding time (about the last ten requests)."""


@dataclass(slots=True, kw_only=True)
class WorkerLoad:
    in_flight: int = 0
    pending_prefill: int = 0
    pending_requests: int = 0
    decode_requests: int = 0
    decode_tokens: int = 0
    service_s: float | None = None
    """Moving average of how long its requests hold it (sent to last byte), from completed ones."""

    def acquire(self, prefill_tokens: int = 0) -> None:
        self.in_flight += 1
        self.pending_prefill += prefill_tokens
        self.pending_requests += 1

    def first_token(self, prefill_tokens: int, context_tokens: int) -> None:
        # Clamped: a worker that left and came back (or a late call after a restart reset it) must not
        # show a negative queue to the policy.
        self.pending_prefill = max(0, self.pending_prefill - prefill_tokens)
        self.pending_requests = max(0, self.pending_requests - 1)
        self.decode_requests += 1
        self.decode_tokens += context_tokens

    def release(self, prefill_tokens: int = 0, context_tokens: int = 0, got_first_token: bool = False,
                held_s: float | None = None) -> None:
        """``held_s``: how long the request held the worker, for a completed one (its average prices the
        wait for a slot on a full worker)."""
        self.in_flight = max(0, self.in_flight - 1)
        if held_s is not None and held_s >= 0:
            s = self.service_s
            self.service_s = held_s if s is None else s + SERVICE_EWMA * (held_s - s)
        if got_first_token:
            self.decode_requests = max(0, self.decode_requests - 1)
            self.decode_tokens = max(0, self.decode_tokens - context_tokens)
        else:
            self.pending_prefill = max(0, self.pending_prefill - prefill_tokens)
            self.pending_requests = max(0, self.pending_requests - 1)
