"""What the session controller knows of one conversation between its requests, and what it has learned
of the whole fleet's traffic.

``SessionState`` is the controller's slice of the conversation record (``session/conversation.py``):
stored with it, shared by every gateway replica through the conversation store, changed only by the
controller's steps. ``Learned`` is fleet-wide: every replica applies the same observations in the same
order (``kvstore/fleet.py``), so they all predict the same waits and continuation rates.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from kvgate.router.types import WorkerId
from kvgate.session.lifecycle import Lifecycle
from kvgate.session.prefill import ContinueStats, PrefillParams
from kvgate.session.waits import WaitParams, WaitPredictor

LAPSE = "lapse"
"""A reservation's deadline: the KV parked for a short tool wait is released."""
PREFETCH = "prefetch"
"""Shortly before a long tool wait is predicted to end: warm the node's CPU tier."""
SETTLE = "settle"
"""``settle_s`` after an answer with no user turn since: the conversation ended."""
PREFILL = "prefill"
"""Right after an answer: decide on (and run) a background prefill of the next turn's prefix."""
TIMER_KINDS = (LAPSE, PREFETCH, SETTLE, PREFILL)


@dataclass(frozen=True, slots=True)
class Reservation:
    worker: WorkerId
    tokens: int
    until: float
    """Wall time the reservation lapses at, even if nobody fires its timer (a replica died)."""
    token: int


@dataclass(frozen=True, slots=True)
class PendingPrefill:
    worker: WorkerId
    divergence: int
    """Tokens of the prefilled prefix the cached chain already had: reuse beyond this is the prefill's."""
    gain_ms: float
    token: int
    running: bool = True


@dataclass(frozen=True, slots=True)
class Answer:
    """The last answer, until a next user turn or ``settle_s`` settles whether the user came back."""

    tenant: str
    size: int
    """The size the continuation is counted under: the next turn's canonical prefix once it is rendered
    (for a background prefill), until then the context at the answer."""
    at: float


@dataclass(frozen=True, slots=True)
class WaitSample:
    tenant: str
    tools: tuple[str, ...]
    waited_s: float
    predicted_s: float


@dataclass(frozen=True, slots=True)
class SessionState:
    lifecycle: Lifecycle = field(default_factory=Lifecycle)
    reservation: Reservation | None = None
    prefill: PendingPrefill | None = None
    answer: Answer | None = None
    timers: tuple[tuple[str, int], ...] = ()
    """Armed timers, (kind, token): a timer that fires with another token is stale and ignored."""
    seq: int = 0
    """The last token handed out (timers, prefills)."""
    pending_wait: WaitSample | None = None
    """The tool wait the request in flight ended: fed back when the request completes."""
    pending_continue: Answer | None = None
    """The answer the request in flight continues (a next user turn): counted when it completes."""

    def timer(self, kind: str) -> int | None:
        return next((t for k, t in self.timers if k == kind), None)

    def with_timer(self, kind: str, token: int) -> SessionState:
        return replace(self, timers=(*((k, t) for k, t in self.timers if k != kind), (kind, token)))

    def without_timer(self, kind: str) -> SessionState:
        return replace(self, timers=tuple((k, t) for k, t in self.timers if k != kind))


@dataclass(frozen=True, slots=True)
class WaitObserved:
    tenant: str
    tools: tuple[str, ...]
    waited_s: float
    predicted_s: float


@dataclass(frozen=True, slots=True)
class ContinuationObserved:
    tenant: str
    size: int
    continued: bool


Observation = WaitObserved | ContinuationObserved


class Learned:
    """Fleet-wide statistics the controller reads: tool waits per (tenant, tool) and how often a
    tenant's users come back after an answer. Changed only by ``apply``, one observation at a time."""

    def __init__(self, waits: WaitParams | None = None, prefill: PrefillParams | None = None) -> None:
        self.waits = WaitPredictor(waits)
        self.continues = ContinueStats(prefill or PrefillParams())

    def apply(self, obs: Observation) -> None:
        if isinstance(obs, WaitObserved):
            self.waits.observe(obs.tenant, obs.tools, obs.waited_s, obs.predicted_s)
        elif obs.continued:
            self.continues.continued(obs.tenant, obs.size)
        else:
            self.continues.ended(obs.tenant, obs.size)
