"""A paged prefix cache that behaves like vLLM v1's ``BlockPool``.

Mechanism only: ref counts, an LRU queue of free blocks, a hash → block map, and an event queue
drained by ``take_events()``. Invariants:
- a block is in ``_free`` iff its ref count is 0;
- a block with a hash is in ``_cached`` under that hash, and vice versa (at most one block per hash);
- a freed block keeps its hash (and stays a cache hit) until it is reused for something else, which
  is when ``BlockRemoved`` is emitted — as vLLM does, never on free; freed blocks without a hash are
  reused first;
- block 0 is vLLM's null block: never allocated, so ``num_blocks`` (vLLM's ``num_gpu_blocks``) gives
  ``num_blocks - 1`` usable blocks, and eviction under ``--num-gpu-blocks-override`` matches vLLM's.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvgate.router.hashing import BlockHash


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    extra_keys: tuple[object, ...] | None = None
    medium: str = "GPU"


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[BlockHash, ...]
    medium: str = "GPU"


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(slots=True)
class _Block:
    id: int
    ref_cnt: int = 0
    hash: BlockHash | None = None


class BlockPool:
    """The free queue is vLLM's, in three parts, front to back: uncached blocks freed recently (reused
    first, LIFO), blocks never used yet (in id order), then freed blocks in LRU order. Never-used blocks
    are a counter, so a pool of millions of blocks costs memory only for the blocks touched."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 2 or block_size <= 0:
            raise ValueError("num_blocks must be >= 2 (one is the null block) and block_size positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._blocks: dict[int, _Block] = {}
        self._front: list[int] = []  # a stack: the last prepended is reused first
        self._next_fresh = 1  # block 0 is the null block
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._cached: dict[BlockHash, int] = {}
        self._events: list[KVEvent] = []

    def _block(self, bid: int) -> _Block:
        b = self._blocks.get(bid)
        if b is None:
            b = self._blocks[bid] = _Block(bid)
        return b

    # -- queries -------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._front) + (self.num_blocks - self._next_fresh) + len(self._lru)

    def usage(self) -> float:
        """vLLM's ``kv_cache_usage_perc``: referenced blocks over usable blocks."""
        return 1.0 - self.num_free / (self.num_blocks - 1)

    def longest_hit(self, hashes: Sequence[BlockHash], max_blocks: int) -> list[int]:
        """Block ids of the longest cached prefix of ``hashes``, at most ``max_blocks`` long."""
        hit: list[int] = []
        for h in hashes[:max_blocks]:
            bid = self._cached.get(h)
            if bid is None:
                break
            hit.append(bid)
        return hit

    def is_free(self, block_id: int) -> bool:
        b = self._blocks.get(block_id)
        return b is None or b.ref_cnt == 0

    def is_cached(self, h: BlockHash) -> bool:
        return h in self._cached

    def cached_hashes(self) -> set[BlockHash]:
        return set(self._cached)

    def host_hit(self, hashes: Sequence[BlockHash], start: int, max_blocks: int) -> int:
        """vLLM's block pool has no host tier (LMCache is modelled beside it, ``tiers.py``)."""
        return 0

    def load_back(self, hashes: Sequence[BlockHash], pages: Sequence[int]) -> float:
        raise ValueError("vLLM's block pool has no host tier")

    # -- mutations -----------------------------------------------------------------------------
    def touch(self, block_ids: Iterable[int]) -> None:
        """Take a reference on cache-hit blocks (pulling free ones out of the LRU queue)."""
        for bid in block_ids:
            b = self._blocks[bid]
            if b.ref_cnt == 0:
                del self._lru[bid]  # a cached block that is free sits in the LRU part
            b.ref_cnt += 1

    def _pop_free(self) -> int:
        if self._front:
            return self._front.pop()
        if self._next_fresh < self.num_blocks:
            self._next_fresh += 1
            return self._next_fresh - 1
        return self._lru.popitem(last=False)[0]

    def allocate(self, n: int) -> list[int] | None:
        """``n`` fresh blocks, evicting the least recently freed cached ones; None if too few are free."""
        if n > self.num_free:
            return None
        out: list[int] = []
        removed: list[BlockHash] = []
        for _ in range(n):
            b = self._block(self._pop_free())
            if b.hash is not None:
                del self._cached[b.hash]
                removed.append(b.hash)
                b.hash = None
            b.ref_cnt = 1
            out.append(b.id)
        for h in removed:
            # One event per evicted block, as vLLM publishes them.
            self._events.append(BlockRemoved((h,)))
        return out

    def cache_blocks(
        self,
        block_ids: Sequence[int],
        hashes: Sequence[BlockHash],
        parent: BlockHash | None,
        token_ids: Sequence[int],
        extra_keys: tuple[object, ...] | None = None,
    ) -> list[int]:
        """Mark newly full blocks as cached under their hashes and emit BlockStored for them. Returns the
        blocks backing them: the request's own (vLLM keeps a duplicate in use rather than swap it)."""
        assert len(block_ids) == len(hashes), "one hash per block"
        assert len(token_ids) == len(hashes) * self.block_size, "token_ids must cover the blocks exactly"
        run: list[int] = []  # indexes of a contiguous run of newly stored blocks
        prev = parent
        for i, (bid, h) in enumerate(zip(block_ids, hashes, strict=True)):
            b = self._blocks[bid]
            if b.hash is not None or h in self._cached:
                # Already cached (a concurrent request computed the same prefix): keep one copy,
                # and close the current run so every event's tokens match its hashes.
                self._emit_stored(run, hashes, token_ids, prev, extra_keys)
                run = []
                continue
            b.hash = h
            self._cached[h] = bid
            if not run:
                prev = hashes[i - 1] if i > 0 else parent
            run.append(i)
        self._emit_stored(run, hashes, token_ids, prev, extra_keys)
        return list(block_ids)

    def _emit_stored(self, run: list[int], hashes: Sequence[BlockHash], token_ids: Sequence[int],
                     parent: BlockHash | None, extra_keys: tuple[object, ...] | None) -> None:
        if not run:
            return
        bs = self.block_size
        toks = tuple(token_ids[run[0] * bs : (run[-1] + 1) * bs])
        # The salt rides on the chain's first block only.
        keys = extra_keys if parent is None else None
        self._events.append(BlockStored(tuple(hashes[i] for i in run), parent, toks, bs, keys))

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop a request's references, tail first, so a chain's last blocks are evicted first.

        As in vLLM 0.32: blocks that hold no cached hash go to the FRONT of the free queue (reused
        first, LIFO), cached ones to the back (evicted last, LRU).
        """
        evict_first: list[int] = []
        for bid in reversed(block_ids):
            b = self._blocks[bid]
            assert b.ref_cnt > 0, f"block {bid} freed more often than referenced"
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                if b.hash is None:
                    evict_first.append(bid)
                else:
                    self._lru[bid] = None
        # prepend_n(evict_first): its first element ends up at the very front.
        self._front.extend(reversed(evict_first))

    def reset(self) -> bool:
        """Drop every cached hash; refused (False) while any block is referenced, as in vLLM."""
        if self.num_free != self.num_blocks - 1:
            return False
        for b in self._blocks.values():
            b.hash = None
        self._cached.clear()
        self._events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVEvent]:
        ev, self._events = self._events, []
        return ev
