"""vLLM / SGLang KV events, decoded and applied to the prefix index. Pure: bytes in, index updates and
instructions (``replay from seq N``) out; the ZMQ adapter lives in ``gateway/kvevents.py``.

Events are lossy (PUB drops under pressure, publishers restart), so every worker's sequence numbers
are tracked:
- the next expected seq arrives: apply;
- on subscribe, reconnect or a detected worker restart (``resync``): drop the worker's entries and
  replay the publisher's buffer from its oldest kept batch (a warm start: a buffer that no longer
  reaches back to the worker's start still gives a safe under-estimate); the live copies of replayed
  batches are recognised by seq and payload digest and skipped;
- the first batch seen is not seq 0: kvgate joined late — replay from 0, warm as above;
- a seq jumps ahead: a gap — ask for a replay from the first missing seq; until it is answered the
  worker's entries are kept but the gap is counted; the replay must be complete, else drop the worker's
  entries rather than trust a stale index;
- a seq goes backwards (and is not a replayed batch's copy): the publisher restarted (its engine's
  cache is empty): clear, then apply;
- the connection drops: the worker is ``stale`` (matched as nothing) until the resync that follows.

Two decoders give the same events: ``decode_batch``, the reference (msgpack, every field, checked event
by event), and ``decode_runs``, what the gateway applies (msgspec typed to the fields kvgate reads, events
merged into runs applied with one set operation each), which hands any payload it does not decode
exactly to the reference.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import msgpack

from kvgate.router.index import PrefixIndex, Tier, tier_of
from kvgate.router.types import WorkerId

try:
    from msgspec import Meta, Struct
    from msgspec import __version__ as _MSGSPEC_VERSION
    from msgspec.msgpack import Decoder
except ImportError:  # pragma: no cover - an environment installed before msgspec was a dependency
    _HAVE_MSGSPEC = False
else:
    _HAVE_MSGSPEC = True


class BadEvent(ValueError):
    """A payload that is not a well-formed event batch."""


@dataclass(frozen=True, slots=True)
class Stored:
    hashes: tuple[int, ...]
    parent: int | None
    tier: Tier


@dataclass(frozen=True, slots=True)
class Removed:
    hashes: tuple[int, ...]
    tier: Tier


@dataclass(frozen=True, slots=True)
class Cleared:
    pass


Event = Stored | Removed | Cleared

# SGLang names its host tier "CPU_PINNED" (HiCache L2); vLLM's offloading connector says "CPU".
_MEDIA = {"CPU_PINNED": "CPU"}

# Field order of the array-encoded (pre-0.26) structs, after the tag.
_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium")
_REMOVED_FIELDS = ("block_hashes", "medium")


def _hash(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int | bytes):
        raise BadEvent(f"block hash must be an int or bytes, got {type(v).__name__}")
    # Raw digests (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0) fold to the same low 64 bits as int events.
    return v if isinstance(v, int) else int.from_bytes(v, "big") & 0xFFFF_FFFF_FFFF_FFFF


def _hashes(v: Any) -> tuple[int, ...]:
    if not isinstance(v, list | tuple) or not v:
        raise BadEvent("block_hashes must be a non-empty array")
    return tuple(_hash(x) for x in v)


def _event(raw: Any) -> Event | None:
    if isinstance(raw, dict):
        kind, fields = raw.get("type"), raw
    elif isinstance(raw, list | tuple) and raw and isinstance(raw[0], str):
        kind = raw[0]
        names = _STORED_FIELDS if kind == "BlockStored" else _REMOVED_FIELDS
        fields = dict(zip(names, raw[1:], strict=False))
    else:
        raise BadEvent("event must be a tagged map or a tagged array")
    if kind == "AllBlocksCleared":
        return Cleared()
    medium = fields.get("medium")
    tier = tier_of(_MEDIA.get(medium, medium) if isinstance(medium, str) else medium)
    if tier is None:
        return None  # a medium kvgate does not track (e.g. disk); not an error
    if kind == "BlockStored":
        parent = fields.get("parent_block_hash")
        return Stored(_hashes(fields.get("block_hashes")), None if parent is None else _hash(parent), tier)
    if kind == "BlockRemoved":
        return Removed(_hashes(fields.get("block_hashes")), tier)
    raise BadEvent(f"unknown event type {kind!r}")


def decode_batch(payload: bytes) -> list[Event]:
    """The reference decoder: every field as msgpack gives it, then checked event by event."""
    try:
        # Strings are not checked as UTF-8: the fast decoder skips the fields kvgate does not read (token
        # ids, LoRA names), so garbage there must not cost a batch here either; a garbled ``type`` or
        # ``medium`` still matches nothing.
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False, unicode_errors="surrogateescape")
    except Exception as exc:  # hostile bytes raise more than ValueError (a map keyed by a map: TypeError)
        raise BadEvent(f"not msgpack: {exc}") from exc
    if not isinstance(batch, list | tuple) or len(batch) < 2 or not isinstance(batch[1], list | tuple):
        raise BadEvent("a batch is [ts, [events...], dp_rank]")
    out = []
    for raw in batch[1]:
        ev = _event(raw)
        if ev is not None:
            out.append(ev)
    return out


@dataclass(frozen=True, slots=True)
class Run:
    """Consecutive events of one kind and tier, their hashes in order: applied to the index in one set
    operation (merging keeps the outcome: set updates of one kind commute, and a removal's unknown
    blocks count the same whether removed one event at a time or all at once)."""

    kind: Literal["store", "remove", "clear"]
    tier: Tier | None
    hashes: tuple[int, ...]
    events: int


def runs_of(events: Iterable[Event]) -> list[Run]:
    """The reference events grouped as the fast decoder groups them (in linear time: a hostile batch of
    many one-block events must not cost its square)."""
    groups: list[tuple[Literal["store", "remove", "clear"], Tier | None, list[int], list[int]]] = []
    for ev in events:
        kind: Literal["store", "remove", "clear"] = ("store" if isinstance(ev, Stored) else
                                                     "remove" if isinstance(ev, Removed) else "clear")
        tier = None if isinstance(ev, Cleared) else ev.tier
        if not groups or groups[-1][0] != kind or groups[-1][1] != tier:
            groups.append((kind, tier, [], [0]))
        if not isinstance(ev, Cleared):
            groups[-1][2].extend(ev.hashes)
        groups[-1][3][0] += 1
    return [Run(kind, tier, tuple(hashes), n) for kind, tier, hashes, (n,) in groups]


_TIER: dict[str | None, Tier] = {None: "GPU", "GPU": "GPU", "CPU": "CPU", "CPU_PINNED": "CPU"}
"""``medium`` -> tier, as ``_MEDIA`` then ``tier_of`` read it (the fast decoder has only strings or None)."""


if _HAVE_MSGSPEC:
    # Typed to what kvgate reads: msgspec skips token ids and every other field in C instead of building
    # Python objects for them (vLLM sends 16 token ids and 11 keys with every stored block). A payload
    # these types do not describe exactly is left to the reference decoder, which has the last word.
    # gc=False: a decoded tree holds no cycles, and tracking 32 structs per batch was ~20% of the decode.
    _Hashes = Annotated[list[int], Meta(min_length=1)]

    class _WireStored(Struct, tag="BlockStored", tag_field="type", gc=False):
        block_hashes: _Hashes
        parent_block_hash: int | None = None
        """Not used: typed so that a batch the reference rejects for it is not accepted here."""
        medium: str | None = None

    class _WireRemoved(Struct, tag="BlockRemoved", tag_field="type", gc=False):
        block_hashes: _Hashes
        medium: str | None = None

    class _WireCleared(Struct, tag="AllBlocksCleared", tag_field="type", gc=False):
        pass

    class _WireBatch(Struct, array_like=True, gc=False):
        ts: float
        events: list[_WireStored | _WireRemoved | _WireCleared]
        dp_rank: int | None = None

    _DECODER = Decoder(_WireBatch)
    """Stateless: holds only the type it decodes."""


def _wire_runs(events: list[_WireStored | _WireRemoved | _WireCleared]) -> list[Run]:
    out: list[Run] = []
    kind: Literal["store", "remove", "clear"] | None = None
    tier: Tier | None = None
    hashes: list[int] = []
    n = 0
    for ev in events:
        if type(ev) is _WireCleared:
            k: Literal["store", "remove", "clear"] = "clear"
            t: Tier | None = None
        else:
            t = _TIER.get(ev.medium)  # type: ignore[union-attr]
            if t is None:
                continue  # a tier kvgate does not track
            k = "store" if type(ev) is _WireStored else "remove"
        if k != kind or t != tier:
            if kind is not None:
                out.append(Run(kind, tier, tuple(hashes), n))
            kind, tier, hashes, n = k, t, [], 0
        if k != "clear":
            hashes += ev.block_hashes  # type: ignore[union-attr]
        n += 1
    if kind is not None:
        out.append(Run(kind, tier, tuple(hashes), n))
    return out


def fast_decoder() -> str:
    """What ``decode_runs`` decodes with (for benchmarks and logs)."""
    return f"msgspec {_MSGSPEC_VERSION}" if _HAVE_MSGSPEC else "none: msgspec is not installed, the reference decodes"


def decode_runs(payload: bytes) -> list[Run]:
    """``runs_of(decode_batch(payload))``, fast for the batches engines send; raises ``BadEvent`` alike."""
    if _HAVE_MSGSPEC:
        try:
            batch = _DECODER.decode(payload)
        except Exception:  # malformed for these types (or too deep): the reference has the last word
            pass
        else:
            return _wire_runs(batch.events)
    return runs_of(decode_batch(payload))


@dataclass(slots=True)
class EventStats:
    applied: int = 0
    batches: int = 0
    malformed: int = 0
    gaps: int = 0
    restarts: int = 0
    replays_failed: int = 0
    unknown_worker: int = 0
    unknown_removals: int = 0
    resyncs: int = 0
    """Streams started over from the publisher's buffer (subscribe, reconnect, worker restart)."""
    duplicates: int = 0
    """Live batches already applied from a replay."""


_DEDUP_KEEP = 4096
"""Replayed batches remembered to recognise their live copies (the SUB queue holds at most the batches
published while the replay was being answered)."""


def _digest(payload: bytes) -> bytes:
    return hashlib.blake2b(payload, digest_size=8).digest()


@dataclass(slots=True)
class _Stream:
    next_seq: int | None = None
    """None: the index holds nothing of this stream (just subscribed, or cleared)."""
    replaying_from: int | None = None
    held: tuple[int, bytes] | None = None
    """The batch that revealed a gap: applied after the replayed ones, so events stay in order."""
    stale: bool = False
    """The connection dropped or a resync is under way: the index may not reflect the worker's cache."""
    warm: bool = False
    """The outstanding replay starts from an empty index, where part of the history is enough."""
    replayed: dict[int, bytes] = field(default_factory=dict)
    """seq -> payload digest of the last replay's tail, to skip their live copies."""


@dataclass
class KvEventState:
    """Every worker's event stream, applied to one index."""

    index: PrefixIndex
    stats: EventStats = field(default_factory=EventStats)
    on_stored: Callable[[WorkerId, tuple[int, ...]], None] | None = None
    """Told of every block a worker reports stored (its prompts in flight have arrived)."""
    reference: bool = False
    """Decode and apply event by event (``decode_batch``): what the fast path is tested against."""
    _streams: dict[WorkerId, _Stream] = field(default_factory=dict)

    def add_worker(self, worker: WorkerId) -> None:
        self._streams.setdefault(worker, _Stream())

    def remove_worker(self, worker: WorkerId) -> None:
        self._streams.pop(worker, None)
        self.index.drop_worker(worker)

    def workers(self) -> list[WorkerId]:
        return list(self._streams)

    def follows(self, worker: WorkerId) -> bool:
        """Whether this worker's KV events feed the index."""
        return worker in self._streams

    def stale(self, worker: WorkerId) -> bool:
        """Whether the worker's entries must not be trusted now (matched as nothing)."""
        st = self._streams.get(worker)
        return st is not None and st.stale

    def mark_stale(self, worker: WorkerId) -> None:
        """The event connection dropped: events may be lost from here until it is back and resynced."""
        st = self._streams.get(worker)
        if st is not None:
            st.stale = True

    def resync(self, worker: WorkerId) -> int | None:
        """Start the worker's stream over: its entries are dropped and the caller replays the publisher's
        buffer from the returned seq (0: from its oldest kept batch). None for an unknown worker."""
        st = self._streams.get(worker)
        if st is None:
            return None
        self.stats.resyncs += 1
        self.index.clear(worker)
        self._streams[worker] = _Stream(replaying_from=0, stale=True, warm=True)
        return 0

    def on_message(self, worker: WorkerId, seq: int, payload: bytes) -> int | None:
        """Apply one published batch. Returns a seq to replay from when a gap was detected."""
        st = self._streams.get(worker)
        if st is None:
            self.stats.unknown_worker += 1
            return None
        if st.replaying_from is not None:
            # A replay is outstanding (the adapter awaits it before reading on): hold on to order.
            return None
        if st.next_seq is not None and seq < st.next_seq and st.replayed.get(seq) == _digest(payload):
            self.stats.duplicates += 1
            return None
        st.replayed.clear()  # the live stream is past the replay: no more copies can come
        if (st.next_seq is None and seq > 0) or (st.next_seq is not None and seq > st.next_seq):
            # Joined late (the publisher sent batches before kvgate subscribed) or batches were lost:
            # replay them first, then this one.
            self.stats.gaps += 1
            st.warm = st.next_seq is None
            st.replaying_from = 0 if st.next_seq is None else st.next_seq
            st.held = (seq, payload)
            st.next_seq = seq + 1
            return st.replaying_from
        if st.next_seq is not None and seq < st.next_seq:
            # The publisher restarted: its engine starts with an empty cache.
            self.stats.restarts += 1
            self.index.clear(worker)
        self._apply(worker, payload)
        st.next_seq = seq + 1
        return None

    def on_replayed(self, worker: WorkerId, batches: Sequence[tuple[int, bytes]]) -> None:
        """Apply a replay's batches in order (a gap's up to and including the batch that revealed it)."""
        st = self._streams.get(worker)
        if st is None or st.replaying_from is None:
            return
        got = sorted({seq: p for seq, p in batches if seq >= st.replaying_from}.items())
        if st.warm:
            self._apply_warm(worker, st, got)
        elif st.held is not None:
            self._apply_gap(worker, st, got, st.held)
        st.replaying_from, st.held, st.warm, st.stale = None, None, False, False

    def _apply_gap(self, worker: WorkerId, st: _Stream, got: list[tuple[int, bytes]], held: tuple[int, bytes]
                   ) -> None:
        # The index already reflects the stream up to the gap: every missing batch is needed, since a lost
        # BlockRemoved would leave a block the worker no longer holds.
        assert st.replaying_from is not None
        missing = [seq for seq, _ in got if seq < held[0]]
        if missing != list(range(st.replaying_from, held[0])):
            self.on_replay_failed(worker)
            return
        for seq, payload in got:
            if seq < held[0]:
                self._apply(worker, payload)
        self._apply(worker, held[1])

    def _apply_warm(self, worker: WorkerId, st: _Stream, got: list[tuple[int, bytes]]) -> None:
        # The index holds nothing of this worker: the publisher's buffer from its oldest kept batch
        # rebuilds it. When the buffer no longer reaches back to the worker's start, the blocks stored
        # before it are missing, but every block the replay leaves in the index is one the worker still
        # holds (all later removals are in the replay too): a safe under-estimate, unlike a gap replay
        # into a non-empty index.
        run = got
        for i in range(len(got) - 1, 0, -1):  # the last contiguous run (a buffer has no holes; be safe)
            if got[i - 1][0] != got[i][0] - 1:
                run = got[i:]
                break
        held = st.held
        if held is not None and (not run or run[-1][0] < held[0] - 1):
            run = []  # the replay does not reach the batch that revealed the gap: start from that batch
        for seq, payload in run:
            if held is None or seq <= held[0]:
                self._apply(worker, payload)
        if held is not None and not any(seq == held[0] for seq, _ in run):
            self._apply(worker, held[1])
        last = max([seq for seq, _ in run] + ([held[0]] if held is not None else []), default=None)
        st.next_seq = None if last is None else last + 1
        st.replayed = {seq: _digest(p) for seq, p in run[-_DEDUP_KEEP:]}

    def on_replay_failed(self, worker: WorkerId) -> None:
        """The gap cannot be filled: the worker's entries may be stale, so forget them, keeping only what
        the newest batch says."""
        st = self._streams.get(worker)
        self.stats.replays_failed += 1
        self.index.clear(worker)
        if st is not None:
            if st.held is not None:
                self._apply(worker, st.held[1])
            st.replaying_from, st.held, st.warm, st.stale = None, None, False, False

    def _apply(self, worker: WorkerId, payload: bytes) -> None:
        if self.reference:
            self._apply_reference(worker, payload)
            return
        try:
            runs = decode_runs(payload)
        except BadEvent:
            self.stats.malformed += 1
            return
        self.stats.batches += 1
        for run in runs:
            self._apply_run(worker, run)

    def _apply_run(self, worker: WorkerId, run: Run) -> None:
        if run.kind == "clear":
            self.index.clear(worker)
        elif run.tier is None:  # pragma: no cover - only clears have no tier
            raise AssertionError(run)
        elif run.kind == "store":
            self.index.store(worker, run.hashes, run.tier)
            if self.on_stored is not None:
                self.on_stored(worker, run.hashes)
        else:
            self.stats.unknown_removals += len(run.hashes) - self.index.remove(worker, run.hashes, run.tier)
        self.stats.applied += run.events

    def _apply_reference(self, worker: WorkerId, payload: bytes) -> None:
        try:
            events = decode_batch(payload)
        except BadEvent:
            self.stats.malformed += 1
            return
        self.stats.batches += 1
        for ev in events:
            if isinstance(ev, Stored):
                self.index.store(worker, ev.hashes, ev.tier)
                if self.on_stored is not None:
                    self.on_stored(worker, ev.hashes)
            elif isinstance(ev, Removed):
                n = self.index.remove(worker, ev.hashes, ev.tier)
                self.stats.unknown_removals += len(ev.hashes) - n
            else:
                self.index.clear(worker)
            self.stats.applied += 1
