"""The Mooncake trace: requests as chained 512-token hash ids, expanded to tokens and block hashes.

Expansion follows Dynamo's replay (so both simulate the same token streams): hash id ``h`` becomes 512
copies of token ``h``, the last chunk cut to ``input_length``. Block hashes are vLLM's; because chunks
are chained, the hashes of a chunk depend only on (parent hash, hash id, length), so they are memoised
and a conversation's next turn hashes only its new chunks — as kvgate does per conversation.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from kvgate.bench.data import open_text
from kvgate.router.hashing import BlockHash, BlockHasher, event_int


@dataclass(frozen=True, slots=True)
class TraceRequest:
    id: int
    arrival_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    @property
    def conversation_key(self) -> str:
        # What kvgate derives for a stateless client: the shared system prompt plus the first user
        # message (the trace's second chunk) identify a conversation.
        return "-".join(str(h) for h in self.hash_ids[:2])


def load_mooncake(path: Path, limit: int | None = None, speedup: float = 1.0) -> list[TraceRequest]:
    out = []
    with open_text(path) as f:
        for i, line in enumerate(f):
            if limit is not None and i >= limit:
                break
            r = json.loads(line)
            out.append(TraceRequest(i, r["timestamp"] / 1000.0 / speedup, int(r["input_length"]),
                                    max(1, int(r["output_length"])), tuple(r["hash_ids"])))
    return out


def time_slice(trace: Sequence[TraceRequest], start: float, end: float) -> list[TraceRequest]:
    """The requests arriving in ``[start, end)`` of the trace's span (fractions), re-timed to start at 0
    and renumbered: the held-out half of a trace is replayed as a trace of its own (cold caches)."""
    t0 = min(r.arrival_s for r in trace)
    span = max(r.arrival_s for r in trace) - t0
    lo, hi = t0 + start * span, t0 + end * span
    picked = sorted((r for r in trace if lo <= r.arrival_s < hi or (end >= 1.0 and r.arrival_s == hi)),
                    key=lambda r: (r.arrival_s, r.id))
    first = picked[0].arrival_s if picked else 0.0  # a trace timestamp: the slice keeps whole milliseconds
    return [replace(r, id=i, arrival_s=round(r.arrival_s - first, 3)) for i, r in enumerate(picked)]


def speed_up(trace: Sequence[TraceRequest], factor: float) -> list[TraceRequest]:
    return [replace(r, arrival_s=r.arrival_s / factor) for r in trace]


def write_mooncake(trace: Iterable[TraceRequest], path: Path) -> Path:
    """The trace in Mooncake's JSONL (timestamps in ms), for tools that read it themselves."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for r in trace:
            f.write(json.dumps({"timestamp": round(r.arrival_s * 1000.0, 3), "input_length": r.input_length,
                                "output_length": r.output_length, "hash_ids": list(r.hash_ids)}) + "\n")
    return path


def _usable(r: TraceRequest, n_chunks: int, chunk: int, block: int) -> int:
    """Tokens an engine with ``block``-token pages reuses for a hit of ``n_chunks`` trace chunks: whole
    pages below the prompt's last token (vLLM recomputes it)."""
    return min(n_chunks * chunk, (r.input_length - 1) // block * block)


def global_lru_reuse(trace: Sequence[TraceRequest], capacity_tokens: int, chunk: int = 512,
                     block: int = 64) -> float:
    """Token reuse of ONE LRU cache holding ``capacity_tokens`` (the whole fleet's KV): no routing, no
    duplicated prefixes, no pinning by running requests, no room for generated tokens. A request hits
    its longest cached prefix of trace chunks, then its chunks are touched tail first, so a chain's
    tail is evicted before its root, as vLLM frees a request's blocks. The reference every table
    carries: a fleet of separate caches of the same total size can approach it, not pass it."""
    cap = max(1, capacity_tokens // chunk)
    lru: OrderedDict[tuple[int, int], None] = OrderedDict()  # (parent chunk key, hash id) -> None
    reused = total = 0
    for r in sorted(trace, key=lambda x: (x.arrival_s, x.id)):
        keys, parent = [], -1
        for h in r.hash_ids:
            keys.append((parent, h))
            parent = h
        n = 0
        for k in keys:
            if k not in lru:
                break
            n += 1
        reused += _usable(r, n, chunk, block)
        total += r.input_length
        for k in reversed(keys):
            lru[k] = None
            lru.move_to_end(k)
        while len(lru) > cap:
            lru.popitem(last=False)
    return reused / total if total else 0.0


def unbounded_reuse(trace: Sequence[TraceRequest], chunk: int = 512, block: int = 64) -> float:
    """One cache of unbounded size: the most reuse any routing could get."""
    return global_lru_reuse(trace, 1 << 62, chunk, block)


class TraceTokens:
    """Tokens and memoised block hashes of trace requests."""

    def __init__(self, hasher: BlockHasher, chunk: int = 512) -> None:
        if chunk % hasher.block_size:
            raise ValueError("the trace chunk must be a multiple of the block size")
        self.hasher = hasher
        self.chunk = chunk
        self._memo: dict[tuple[bytes | None, int, int], list[BlockHash]] = {}
        self.hashed_blocks = 0

    def tokens(self, r: TraceRequest) -> list[int]:
        out: list[int] = []
        for h in r.hash_ids:
            out.extend([h] * self.chunk)
        return out[: r.input_length]

    def block_hashes(self, r: TraceRequest) -> list[BlockHash]:
        bs = self.hasher.block_size
        out: list[BlockHash] = []
        parent: BlockHash | None = None
        for j, h in enumerate(r.hash_ids):
            n = min(self.chunk, r.input_length - j * self.chunk)
            if n < bs:
                break
            key = (parent, h, n)
            got = self._memo.get(key)
            if got is None:
                got = self.hasher.block_hashes([h] * (n - n % bs), parent=parent, start_block=len(out))
                self._memo[key] = got
                self.hashed_blocks += len(got)
            out.extend(got)
            parent = got[-1]
            if n < self.chunk:
                break
        return out

    @staticmethod
    def ints(hashes: list[BlockHash]) -> list[int]:
        return [event_int(h) for h in hashes]
