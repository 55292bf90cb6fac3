"""One request on its way through the gateway: what ``prepare`` makes of it, and the exchange with the
worker that accepted it, up to the record of its outcome."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from kvgate.admission.gate import Ticket
from kvgate.gateway.engine_ids import EngineIds
from kvgate.gateway.identity import Identity
from kvgate.gateway.prompts import Prompt
from kvgate.gateway.telemetry import DecodeTiming
from kvgate.gateway.tracing import OFF, RequestTrace
from kvgate.gateway.turns import Reply
from kvgate.history.canonical import Canonical
from kvgate.history.loss import PromptLoss
from kvgate.history.protocols import ModelProtocol
from kvgate.router.types import Decision, WorkerId
from kvgate.session.controller import Step
from kvgate.session.conversation import Conversation

Endpoint = Literal["chat", "completions"]
PATHS: dict[Endpoint, str] = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


class ClientGone(Exception):
    """The client disconnected while kvgate was waiting on the worker."""


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    @classmethod
    def parse(cls, obj: Any) -> Usage | None:
        if not isinstance(obj, dict):
            return None
        details = obj.get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens") if isinstance(details, dict) else 0
        try:
            return cls(int(obj.get("prompt_tokens") or 0), int(obj.get("completion_tokens") or 0), int(cached or 0))
        except (TypeError, ValueError):
            return None


@dataclass(slots=True)
class Turn:
    """Chat only: the canonical history sent, its policy, the loss explanation."""

    canonical: Canonical
    protocol: ModelProtocol
    tools: Any = None
    loss: PromptLoss | None = None
    strip_ids: bool = False
    """kvgate asked the worker for token ids (``return_token_ids``): read, then removed from the answer."""


@dataclass(slots=True)
class Prepared:
    """A validated request, identified, canonicalised and tokenized: ready to route."""

    endpoint: Endpoint
    model: str
    ident: Identity
    conv: Conversation | None
    """The conversation's record as it was when the request arrived (None: a new conversation)."""
    prompt: Prompt
    payload: bytes
    """The body forwarded to the worker (kvgate's fields removed, usage requested)."""
    headers: dict[str, str]
    stream: bool
    hide_usage: bool
    """kvgate asked for usage the client did not: keep it out of the client's stream."""
    arrival: Step
    """The session controller's arrival step (its commands run in ``arrival_task``)."""
    arrived_at: float
    """Wall time the request arrived."""
    user_turn: bool
    turn: Turn | None = None
    arrival_task: asyncio.Task[Any] | None = None
    trace: RequestTrace = OFF
    """The request's trace (``OFF`` when tracing is off or the request is not sampled)."""
    show_cache: bool = True
    """The caller may see kvgate's cache figures (auth: its own salt, or an operator)."""
    cache_salt: str | None = None
    """The salt kvgate put in the body (auth on): the tiers are probed under it."""
    ticket: Ticket | None = None
    """Admission's quota lease and fleet slot (admission on): released when the request ends."""
    parent_home: WorkerId | None = None
    """A new sub-agent's parent conversation's worker: where the parent's shared prefix most likely is."""
    store_response: bool = True
    """The reply's response id is recorded for ``previous_response_id`` (chat's ``store: false``: not, so
    nothing can continue from it; the conversation's routing state is kept as for any request)."""
    finish_prompt: Callable[[], Prompt] | None = None
    """The prompt tokenized whole (``prompt`` holds only as much as routing needed): run off the event
    loop once the request is sent, into ``prompt_task``."""
    prompt_task: asyncio.Future[None] | None = None
    """``finish_prompt`` running; the record awaits it (the turn's chain is built from the whole prompt)."""
    retain_s: float | None = None
    """How long the request asked for its KV to be kept (``session/retention.py``; None: not asked)."""


@dataclass(slots=True)
class Exchange:
    """The attempt a worker accepted: what is needed to relay it and record its outcome."""

    prepared: Prepared
    decision: Decision
    started: float
    node: str
    block_size: int
    chosen_matched_tokens: int = 0
    best_matched_tokens: int = 0
    ttft_s: float | None = None
    usage: Usage | None = None
    reply: Reply = field(default_factory=Reply)
    response_id: str | None = None
    decode: DecodeTiming | None = None
    """Streams: output event times from the first output on (ITL, TPOT)."""
    engine_ids: EngineIds | None = None
    """The engine's prompt and output token ids, when kvgate asked for them."""

    @property
    def prefill_tokens(self) -> int:
        return max(1, self.prepared.prompt.length - self.decision.expected_cached_tokens)
