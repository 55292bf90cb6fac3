"""The Mooncake trace: requests as chained 512-token hash ids, expanded to tokens and block hashes.

Expansion follows Dynamo's replay (so both simulate the same token streams): hash id ``h`` becomes 512
copies of token ``h``, the last chunk cut to ``input_length``. Block hashes are vLLM's; because chunks
are chained, the hashes of a chunk depend only on (parent hash, hash id, length), so they are memoised
and a conversation's next turn hashes only its new chunks — as kvgate does per conversation.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from kvgate.router.hashing import BlockHash, VllmHasher, event_int


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
    with open(path) as f:
        for i, line in enumerate(f):
            if limit is not None and i >= limit:
                break
            r = json.loads(line)
            out.append(TraceRequest(i, r["timestamp"] / 1000.0 / speedup, int(r["input_length"]),
                                    max(1, int(r["output_length"])), tuple(r["hash_ids"])))
    return out


class TraceTokens:
    """Tokens and memoised block hashes of trace requests."""

    def __init__(self, hasher: VllmHasher, chunk: int = 512) -> None:
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
