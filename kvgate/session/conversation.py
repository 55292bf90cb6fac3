"""One record per conversation: everything kvgate keeps of it, in one place with one bound.

A conversation's record holds its home worker, the controller's state (lifecycle, reservation,
prefill, timers), the per-turn records, and the last completed turn: the canonical history as sent
plus the reply, the tools, the exact replies the worker generated (for restoring re-serialised echoes),
the response ids kvgate answered with (for ``previous_response_id``), and the chain the worker cached
(rendered text and tokens, for incremental tokenization and the loss explanation). The memory store
keeps these objects; the Redis store serialises them (``kvstore/codec.py``) so every gateway replica
reads the same record.

Records are immutable; a change is a new record written with compare-and-set on ``version``. The
record is written only when a request completes: a request that fails or that the worker rejects
leaves nothing behind.
"""

from __future__ import annotations

from array import array
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from kvgate.router.residency import Residency
from kvgate.router.types import ConversationId, WorkerId
from kvgate.sequences import common_prefix
from kvgate.session.state import SessionState

Message = dict[str, Any]


@dataclass(frozen=True, slots=True)
class TurnRecord:
    worker: WorkerId
    reason: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    ttft_s: float | None
    expected_cached_tokens: int = 0
    tier: str = "none"
    lost_tokens: int = 0
    """History the prompt could have reused and did not (see history/loss.py)."""
    loss_cause: str | None = None
    loss_detail: str = ""
    cache_lost_tokens: int = 0
    """Reusable prefix the chosen worker did not have."""
    cache_loss_cause: str | None = None
    at: float = 0.0
    """Wall time the turn completed."""
    recomputed_tokens: int = 0
    """History tokens prefilled again because canonicalisation made the prompt diverge from the cached
    chain (the ``reasoning_dropped`` loss; docs/operations.md)."""
    kv_bytes: int = 0
    """The KV the turn left on its worker (prompt + completion in whole blocks x the model's KV bytes per
    token); 0 when the model's geometry is unknown."""
    tpot_s: float | None = None
    """Streams: (last output - first output) / (completion tokens - 1)."""
    trace_id: str = ""
    span_id: str = ""
    """The request's trace and span (hex) when it was traced: background work links to them."""

    @property
    def uncached_prefill_tokens(self) -> int:
        return max(0, self.prompt_tokens - self.cached_tokens)

    @property
    def active_context_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True, slots=True)
class Totals:
    """A conversation's figures for agents summed over all its turns (the turn records keep the last
    ``max_turns``)."""

    turns: int = 0
    prompt_tokens: int = 0
    cached_input_tokens: int = 0
    uncached_prefill_tokens: int = 0
    recomputed_history_tokens: int = 0
    completion_tokens: int = 0
    ttft_s: float = 0.0
    ttft_count: int = 0
    tpot_s: float = 0.0
    tpot_count: int = 0

    def plus(self, t: TurnRecord) -> Totals:
        return Totals(self.turns + 1, self.prompt_tokens + t.prompt_tokens, self.cached_input_tokens + t.cached_tokens,
                      self.uncached_prefill_tokens + t.uncached_prefill_tokens,
                      self.recomputed_history_tokens + t.recomputed_tokens,
                      self.completion_tokens + t.completion_tokens,
                      self.ttft_s + (t.ttft_s or 0.0), self.ttft_count + (t.ttft_s is not None),
                      self.tpot_s + (t.tpot_s or 0.0), self.tpot_count + (t.tpot_s is not None))


@dataclass(frozen=True, slots=True)
class Chain:
    """The last completed turn as the worker cached it: the history and reply rendered as the engine
    renders them, and its tokens.

    The anchors are (character offset, token index) pairs at every special token of ``text``:
    tokenization never crosses a special token, so the next prompt is tokenized only from the last
    anchor before the first character it changes. ``hashes`` caches the block hashes of ``tokens`` per
    hash identity: (block size, digests, event ints) — derived, never stored."""

    text: str
    tokens: array[int]
    anchor_chars: array[int]
    anchor_tokens: array[int]
    engine: array[int] | None = None
    """The same turn as the engine holds it, when it returned its token ids (its prompt, then what it
    generated): the loss explanation compares with these and tells retokenization apart."""
    hashes: dict[Hashable, tuple[int, list[bytes], list[int]]] = field(default_factory=dict, compare=False)

    @property
    def nbytes(self) -> int:
        return (len(self.text) + 4 * (len(self.tokens) + len(self.anchor_chars) + len(self.anchor_tokens)
                                      + (len(self.engine) if self.engine is not None else 0)))


@dataclass(frozen=True, slots=True)
class Limits:
    max_turns: int = 64
    """Turn records kept (``turn_count`` counts them all)."""
    max_exact: int = 256
    """Exact replies kept for restoration."""
    max_responses: int = 64
    """Response ids a stateful continuation may name."""
    max_bytes: int = 4 * 1024 * 1024
    """One conversation's record in bytes (approximate): over it, the chain goes first (incremental
    tokenization and loss explanation fall back to full work), then the oldest exact replies, then
    the stored history (stateful continuations of it then answer 404)."""


@dataclass(frozen=True, slots=True)
class Conversation:
    id: ConversationId
    tenant: str = ""
    id_source: str = ""
    """How the id was found: ``header:<name>``, ``body``, ``derived`` or ``previous_response_id``."""
    version: int = 0
    """Bumped by every write; a store refuses a write based on a stale version (no lost updates)."""
    created: float = 0.0
    last_activity: float = 0.0
    """Wall time of the last completed turn (meaningful across replicas and restarts)."""
    home: WorkerId | None = None
    session: SessionState = field(default_factory=SessionState)
    residency: Residency = field(default_factory=Residency)
    """Where LMCache's node L1 tiers hold the conversation's prefix, as far as kvgate can tell."""
    turns: tuple[TurnRecord, ...] = ()
    turn_count: int = 0
    totals: Totals = field(default_factory=Totals)
    model: str = ""
    history: tuple[Message, ...] = ()
    """The last completed turn's canonical messages as sent, then the reply."""
    tools: Any = None
    chain: Chain | None = None
    exact: tuple[Message, ...] = ()
    responses: tuple[str, ...] = ()
    body_gen: int = 0
    """Bumped whenever model, history, tools, chain, exact or responses change: a replica that already
    holds this generation of them need not read them again."""
    reset: str = ""
    """Why the store replaced what it held of this conversation with a fresh record (it was corrupt);
    empty for a record that was never reset."""
    extras: Mapping[str, Mapping[str, Any]] = field(default_factory=dict, compare=False)
    """Fields written by a newer kvgate that this one does not know, kept to be written back."""
    sizes: BodySizes | None = field(default=None, compare=False, repr=False)
    """What ``body_bytes`` last measured of this record or one before it (derived, never stored)."""

    def with_turn(self, turn: TurnRecord, limits: Limits) -> Conversation:
        return replace(self, home=turn.worker, last_activity=turn.at, turns=(*self.turns, turn)[-limits.max_turns:],
                       turn_count=self.turn_count + 1, totals=self.totals.plus(turn))

    def with_reply(self, model: str, history: tuple[Message, ...], reply: Message, tools: Any,
                   chain: Chain | None, response_id: str | None, limits: Limits) -> Conversation:
        """The completed turn becomes the conversation's last: its history, exact reply and chain."""
        responses = self.responses if not response_id else (*self.responses, response_id)[-limits.max_responses:]
        conv = replace(self, model=model, history=(*history, reply), tools=tools, chain=chain,
                       exact=(*self.exact, reply)[-limits.max_exact:], responses=responses,
                       body_gen=self.body_gen + 1)
        return conv.within(limits)

    def within(self, limits: Limits) -> Conversation:
        """The record cut to ``limits.max_bytes``: the chain dropped first, then the oldest exact replies,
        then the history (with the tools and response ids). Sized from ``sizes``: a turn costs what it
        added, not a walk of the whole history."""
        m = self.measured()
        total = m.total + (self.chain.nbytes if self.chain is not None else 0)
        if total <= limits.max_bytes:
            return replace(self, sizes=m) if m is not self.sizes else self
        conv = self
        if conv.chain is not None:
            total -= conv.chain.nbytes
            conv = replace(conv, chain=None)
        drop = 0
        while total > limits.max_bytes and drop < len(m.exact_sizes):
            total -= m.exact_sizes[drop]
            drop += 1
        if drop:
            exact = conv.exact[drop:]
            m = BodySizes(m.history, m.history_sizes, exact, m.exact_sizes[drop:], m.tools, m.tools_bytes,
                          m.total - sum(m.exact_sizes[:drop]))
            conv = replace(conv, exact=exact)
        if total > limits.max_bytes:
            conv = replace(conv, history=(), tools=None, responses=())
            return replace(conv, sizes=BodySizes((), array("q"), conv.exact, m.exact_sizes, None, 0,
                                                 sum(m.exact_sizes)))
        return replace(conv, sizes=m)

    def body_bytes(self) -> int:
        chain = self.chain.nbytes if self.chain is not None else 0
        return self.measured().total + chain

    def measured(self) -> BodySizes:
        """The sizes of this record's history, exact replies and tools, measuring only the parts that
        ``sizes`` (an earlier version's) does not hold."""
        m = self.sizes
        if m is not None and m.history is self.history and m.exact is self.exact and m.tools is self.tools:
            return m
        h = _item_sizes(self.history, m.history if m else (), m.history_sizes if m else array("q"))
        e = _item_sizes(self.exact, m.exact if m else (), m.exact_sizes if m else array("q"))
        if m is not None and (m.tools is self.tools or m.tools == self.tools):
            tools = m.tools_bytes  # the request's tools, parsed again each turn: equal, the same size
        else:
            tools = _value_bytes(self.tools) if self.tools else 0
        return BodySizes(self.history, h, self.exact, e, self.tools, tools, sum(h) + sum(e) + tools)


class BodySizes:
    """A record's body sizes as measured, with the parts they measure (held: identity says which parts
    a later version shares). A plain slotted class, not a dataclass or tuple: the store's byte
    accounting walks those whole, and would walk the history again through this every write."""

    __slots__ = ("exact", "exact_sizes", "history", "history_sizes", "tools", "tools_bytes", "total")

    def __init__(self, history: tuple[Message, ...], history_sizes: array[int], exact: tuple[Message, ...],
                 exact_sizes: array[int], tools: Any, tools_bytes: int, total: int) -> None:
        self.history, self.history_sizes = history, history_sizes
        self.exact, self.exact_sizes = exact, exact_sizes
        self.tools, self.tools_bytes, self.total = tools, tools_bytes, total


def _item_sizes(msgs: tuple[Message, ...], held: tuple[Message, ...], sizes: array[int]) -> array[int]:
    """Each message's size, taken from ``sizes`` (of ``held``) for the run of ``msgs`` that a run of
    ``held`` starts (a turn keeps all of the history, the exact replies but their oldest) and measured
    for the rest. Matched by equality (identity first, in C): equal messages have equal sizes."""
    if msgs is held:
        return sizes
    d = -1
    if msgs and held:
        try:
            d = held.index(msgs[0])
        except ValueError:
            pass
    run = common_prefix(held[d:], msgs) if d >= 0 else 0
    out = sizes[d:d + run] if run else array("q")
    out.extend(_value_bytes(x) for x in msgs[run:])
    return out


def _messages_bytes(msgs: tuple[Message, ...]) -> int:
    """Approximate: the strings a message holds dominate its size."""
    return sum(_value_bytes(m) for m in msgs)


def _value_bytes(v: Any) -> int:
    if isinstance(v, str):
        return len(v) + 8
    if isinstance(v, dict):
        return sum(len(k) + _value_bytes(x) for k, x in v.items()) + 16
    if isinstance(v, list | tuple):
        return sum(_value_bytes(x) for x in v) + 16
    return 16
