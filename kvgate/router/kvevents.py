"""vLLM / SGLang KV events, decoded and applied to the prefix index. Pure: bytes in, index updates and
instructions (``replay from seq N``) out; the ZMQ adapter lives in ``gateway/kvevents.py``.

Events are lossy (PUB drops under pressure, publishers restart), so every worker's sequence numbers
are tracked:
- the next expected seq arrives: apply;
- the first batch seen is not seq 0: kvgate joined late — replay from 0 (the publisher keeps a buffer);
- a seq jumps ahead: a gap — ask for a replay from the first missing seq; until it is answered the
  worker's entries are kept but the gap is counted; if the replay fails, drop the worker's entries
  rather than trust a stale index;
- a seq goes backwards: the publisher restarted (its engine's cache is empty): clear, then apply.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack

from kvgate.router.index import PrefixIndex, Tier, tier_of
from kvgate.router.types import WorkerId


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
    tier = tier_of(fields.get("medium"))
    if tier is None:
        return None  # a medium kvgate does not track (e.g. disk); not an error
    if kind == "BlockStored":
        parent = fields.get("parent_block_hash")
        return Stored(_hashes(fields.get("block_hashes")), None if parent is None else _hash(parent), tier)
    if kind == "BlockRemoved":
        return Removed(_hashes(fields.get("block_hashes")), tier)
    raise BadEvent(f"unknown event type {kind!r}")


def decode_batch(payload: bytes) -> list[Event]:
    try:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, msgpack.UnpackException) as exc:
        raise BadEvent(f"not msgpack: {exc}") from exc
    if not isinstance(batch, list | tuple) or len(batch) < 2 or not isinstance(batch[1], list | tuple):
        raise BadEvent("a batch is [ts, [events...], dp_rank]")
    out = []
    for raw in batch[1]:
        ev = _event(raw)
        if ev is not None:
            out.append(ev)
    return out


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


@dataclass(slots=True)
class _Stream:
    next_seq: int | None = None
    replaying_from: int | None = None
    held: tuple[int, bytes] | None = None
    """The batch that revealed a gap: applied after the replayed ones, so events stay in order."""


@dataclass
class KvEventState:
    """Every worker's event stream, applied to one index."""

    index: PrefixIndex
    stats: EventStats = field(default_factory=EventStats)
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

    def on_message(self, worker: WorkerId, seq: int, payload: bytes) -> int | None:
        """Apply one published batch. Returns a seq to replay from when a gap was detected."""
        st = self._streams.get(worker)
        if st is None:
            self.stats.unknown_worker += 1
            return None
        if st.replaying_from is not None:
            # A replay is outstanding (the adapter awaits it before reading on): hold on to order.
            return None
        if (st.next_seq is None and seq > 0) or (st.next_seq is not None and seq > st.next_seq):
            # Joined late (the publisher sent batches before kvgate subscribed) or batches were lost:
            # replay them first, then this one.
            self.stats.gaps += 1
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
        """Apply a gap's replayed batches in order, up to and including the batch that revealed it."""
        st = self._streams.get(worker)
        if st is None or st.replaying_from is None or st.held is None:
            return
        held_seq, held_payload = st.held
        seqs = sorted(seq for seq, _ in batches if st.replaying_from <= seq < held_seq)
        if seqs != list(range(st.replaying_from, held_seq)):
            # The publisher's buffer no longer holds every missing batch: what is left is not enough.
            self.on_replay_failed(worker)
            return
        seen_held = False
        for seq, payload in batches:
            if st.replaying_from <= seq <= held_seq:
                self._apply(worker, payload)
                seen_held = seen_held or seq == held_seq
        if not seen_held:
            self._apply(worker, held_payload)
        st.replaying_from, st.held = None, None

    def on_replay_failed(self, worker: WorkerId) -> None:
        """The gap cannot be filled: the worker's entries may be stale, so forget them, keeping only what
        the newest batch says."""
        st = self._streams.get(worker)
        self.stats.replays_failed += 1
        self.index.clear(worker)
        if st is not None:
            if st.held is not None:
                self._apply(worker, st.held[1])
            st.replaying_from, st.held = None, None

    def _apply(self, worker: WorkerId, payload: bytes) -> None:
        try:
            events = decode_batch(payload)
        except BadEvent:
            self.stats.malformed += 1
            return
        self.stats.batches += 1
        for ev in events:
            if isinstance(ev, Stored):
                self.index.store(worker, ev.hashes, ev.tier)
            elif isinstance(ev, Removed):
                n = self.index.remove(worker, ev.hashes, ev.tier)
                self.stats.unknown_removals += len(ev.hashes) - n
            else:
                self.index.clear(worker)
            self.stats.applied += 1
