"""A paged prefix cache that behaves like SGLang 0.5.23's ``RadixCache`` (``srt/mem_cache/radix_cache.py``),
behind the same interface as ``blockpool.BlockPool`` so ``EngineCore`` drives either.

What differs from vLLM's block pool, as SGLang does it:
- the tree is a radix tree of nodes, each a run of pages; a lookup that ends inside a node splits it
  (``_match_prefix_helper``), and every node on a looked-up or inserted path is refreshed for LRU;
- only page-aligned prefixes enter the tree (``RadixKey.page_aligned``): a request's trailing partial page
  is its own and is freed with it, never cached;
- a page inserted a second time (two requests computed the same prefix) is a duplicate: the request
  switches to the tree's page and its copy is freed at once;
- eviction removes whole unlocked LEAF nodes, least recently accessed first, and only when an
  allocation needs the room: a freed page stays a cache hit until then;
- events: one ``BlockStored`` per new node, coalesced with the queue's tail when it continues the tail's
  chain (``KVCacheEventRecorder.enqueue``); one ``BlockRemoved`` per evicted node, coalesced with a
  ``BlockRemoved`` tail; ``AllBlocksCleared`` on a flush.
Page references stand for SGLang's node locks: a request holds every page of its prefix, so a node is
locked exactly when one of its pages is referenced.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvgate.router.hashing import BlockHash
from kvgate.sim.blockpool import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent


@dataclass(eq=False, slots=True)
class _Node:
    hashes: list[BlockHash]
    pages: list[int]
    tokens: list[int]
    parent: _Node | None
    children: dict[BlockHash, _Node] = field(default_factory=dict)
    access: int = 0
    salt: str | None = None
    host: bool = False
    """Backed up to a host tier (HiCache, ``hicache.py``); never in the plain radix cache."""
    on_device: bool = True
    """Its pages are on the GPU; False for a node HiCache demoted to host (``pages`` is then empty)."""


class RadixPool:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._root = _Node([], [], [], None)
        self._refs: dict[int, int] = {}
        self._free: list[int] = []
        self._next_fresh = 0
        self._where: dict[BlockHash, tuple[_Node, int]] = {}
        self._page_hash: dict[int, BlockHash] = {}
        self._clock = itertools.count(1)
        self._n_evictable = 0
        """Tree pages nobody references (SGLang's ``evictable_size``), kept in step with every change."""
        self._events: list[KVEvent] = []

    # -- queries -------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Free pages plus the tree's unlocked ones (SGLang's available + evictable)."""
        return len(self._free) + (self.num_blocks - self._next_fresh) + self._n_evictable

    def usage(self) -> float:
        """``sglang:token_usage``: pages neither free nor evictable, over all pages."""
        return 1.0 - self.num_free / self.num_blocks

    def is_free(self, block_id: int) -> bool:
        return self._refs.get(block_id, 0) == 0

    def is_cached(self, h: BlockHash) -> bool:
        return h in self._where

    def cached_hashes(self) -> set[BlockHash]:
        return set(self._where)

    def longest_hit(self, hashes: Sequence[BlockHash], max_blocks: int) -> list[int]:
        """Pages of the longest cached prefix of ``hashes`` (at most ``max_blocks``), splitting the node
        the match ends in and refreshing the path, as SGLang's ``match_prefix`` does."""
        now = next(self._clock)
        node, i, out = self._root, 0, []
        node.access = now
        want = hashes[:max_blocks]
        while i < len(want):
            child = node.children.get(want[i])
            if child is None or not child.on_device:
                break
            child.access = now
            k = 0
            while k < len(child.hashes) and i + k < len(want) and child.hashes[k] == want[i + k]:
                k += 1
            if k < len(child.hashes):
                child = self._split(child, k)
            out.extend(child.pages)
            node, i = child, i + k
        return out

    def host_hit(self, hashes: Sequence[BlockHash], start: int, max_blocks: int) -> int:
        """Pages after the device hit ``hashes[:start]`` that a host tier holds (none here)."""
        return 0

    def load_back(self, hashes: Sequence[BlockHash], pages: Sequence[int]) -> float:
        """Copy the host-held pages ``hashes`` into the device ``pages``; returns the copy's milliseconds."""
        raise ValueError("this cache has no host tier")

    # -- mutations -----------------------------------------------------------------------------
    def touch(self, block_ids: Iterable[int]) -> None:
        for b in block_ids:
            r = self._refs.get(b, 0)
            if r == 0 and b in self._page_hash:
                self._n_evictable -= 1
            self._refs[b] = r + 1

    def allocate(self, n: int) -> list[int] | None:
        if n > self.num_free:
            return None
        short = n - len(self._free) - (self.num_blocks - self._next_fresh)
        if short > 0:
            self.evict(short)
        out = []
        for _ in range(n):
            if self._free:
                b = self._free.pop()
            else:
                b = self._next_fresh
                self._next_fresh += 1
            self._refs[b] = 1
            out.append(b)
        return out

    def free(self, block_ids: Sequence[int]) -> None:
        for b in block_ids:
            r = self._refs.get(b, 0)
            assert r > 0, f"page {b} freed more often than referenced"
            if r > 1:
                self._refs[b] = r - 1
                continue
            del self._refs[b]
            if b in self._page_hash:
                self._n_evictable += 1
            else:
                self._free.append(b)

    def cache_blocks(self, block_ids: Sequence[int], hashes: Sequence[BlockHash], parent: BlockHash | None,
                     token_ids: Sequence[int], extra_keys: tuple[object, ...] | None = None) -> list[int]:
        """Insert a request's newly computed full pages under ``parent``; returns the pages that now back
        them (the tree's, where the prefix was already there: the request's copies are freed)."""
        assert len(block_ids) == len(hashes) and len(token_ids) == len(hashes) * self.block_size
        salt = str(extra_keys[0]) if extra_keys else None
        node, idx = (self._root, -1) if parent is None else self._where[parent]
        now = next(self._clock)
        up: _Node | None = node
        while up is not None:  # SGLang walks the inserted key from the root
            up.access = now
            up = up.parent
        out: list[int] = []
        bs = self.block_size
        for i, h in enumerate(hashes):
            if idx == len(node.hashes) - 1:
                child = node.children.get(h)
                if child is None:
                    out.extend(self._new_node(node, hashes[i:], block_ids[i:], token_ids[i * bs :], salt))
                    break
                node, idx = child, 0
                node.access = now
            elif node.hashes[idx + 1] == h:
                idx += 1
            else:
                node = self._split(node, idx + 1)
                out.extend(self._new_node(node, hashes[i:], block_ids[i:], token_ids[i * bs :], salt))
                break
            tree_page = node.pages[idx]
            if tree_page != block_ids[i]:
                self.touch([tree_page])
                self.free([block_ids[i]])
            out.append(tree_page)
        return out

    def _new_node(self, parent: _Node, hashes: Sequence[BlockHash], pages: Sequence[int], tokens: Sequence[int],
                  salt: str | None) -> list[int]:
        # A node's time is its creation's, a moment after the call's (SGLang stamps ``TreeNode()``).
        node = _Node(list(hashes), list(pages), list(tokens), parent, access=next(self._clock), salt=salt)
        parent.children[hashes[0]] = node
        for k, (h, p) in enumerate(zip(hashes, pages, strict=True)):
            self._where[h] = (node, k)
            self._page_hash[p] = h
        self._enqueue(BlockStored(tuple(hashes), parent.hashes[-1] if parent.hashes else None, tuple(tokens),
                                  self.block_size, (salt,) if salt else None))
        self._inserted(node)
        return list(pages)

    def _inserted(self, node: _Node) -> None:
        """A new node entered the tree (HiCache backs it up to host here)."""

    def _split(self, child: _Node, k: int) -> _Node:
        """Cut ``child`` after its first ``k`` pages; the new upper node is stamped fresh, as SGLang's is."""
        assert child.parent is not None and 0 < k < len(child.hashes)
        bs = self.block_size
        top = _Node(child.hashes[:k], child.pages[:k], child.tokens[: k * bs], child.parent,
                    access=next(self._clock), salt=child.salt, host=child.host, on_device=child.on_device)
        child.parent.children[top.hashes[0]] = top
        child.hashes, child.pages, child.tokens = child.hashes[k:], child.pages[k:], child.tokens[k * bs :]
        child.parent = top
        top.children[child.hashes[0]] = child
        for j, h in enumerate(top.hashes):
            self._where[h] = (top, j)
        for j, h in enumerate(child.hashes):
            self._where[h] = (child, j)
        return top

    def _unlocked(self, n: _Node) -> bool:
        return all(self._refs.get(p, 0) == 0 for p in n.pages)

    def _is_evictable_leaf(self, n: _Node) -> bool:
        return not n.children and self._unlocked(n)

    def _evictable_leaves(self) -> list[_Node]:
        out, stack = [], list(self._root.children.values())
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            if self._is_evictable_leaf(n):
                out.append(n)
        return out

    def evict(self, pages: int) -> None:
        """Drop least recently used unlocked leaves until ``pages`` are free (``RadixCache.evict``)."""
        freed = 0
        leaves = self._evictable_leaves()
        while freed < pages and leaves:
            victim = min(leaves, key=lambda n: n.access)
            leaves.remove(victim)
            parent = victim.parent
            assert parent is not None
            freed += self._evict_node(victim)
            if parent is not self._root and parent not in leaves and self._is_evictable_leaf(parent):
                leaves.append(parent)

    def _free_device_pages(self, n: _Node) -> int:
        for p in n.pages:
            del self._page_hash[p]
            self._free.append(p)
        self._n_evictable -= len(n.pages)
        freed, n.pages = len(n.pages), []
        return freed

    def _delete(self, n: _Node) -> None:
        assert n.parent is not None
        del n.parent.children[n.hashes[0]]
        for h in n.hashes:
            del self._where[h]

    def _evict_node(self, victim: _Node) -> int:
        """Take ``victim`` off the device; returns the pages freed."""
        self._delete(victim)
        self._enqueue(BlockRemoved(tuple(victim.hashes)))
        return self._free_device_pages(victim)

    def _enqueue(self, ev: KVEvent) -> None:
        tail = self._events[-1] if self._events else None
        if isinstance(ev, BlockRemoved) and isinstance(tail, BlockRemoved) and tail.medium == ev.medium:
            self._events[-1] = BlockRemoved(tail.block_hashes + ev.block_hashes, tail.medium)
            return
        if (isinstance(ev, BlockStored) and isinstance(tail, BlockStored) and tail.medium == ev.medium
                and tail.extra_keys == ev.extra_keys and ev.parent_block_hash == tail.block_hashes[-1]):
            self._events[-1] = BlockStored(tail.block_hashes + ev.block_hashes, tail.parent_block_hash,
                                           tail.token_ids + ev.token_ids, tail.block_size, tail.extra_keys,
                                           tail.medium)
            return
        self._events.append(ev)

    def reset(self) -> bool:
        """``/flush_cache``: refused while any page is in use, as SGLang refuses unless idle."""
        if self._refs:
            return False
        self._root = _Node([], [], [], None)
        self._where.clear()
        self._page_hash.clear()
        self._free.clear()
        self._next_fresh = 0
        self._n_evictable = 0
        self._enqueue(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVEvent]:
        ev, self._events = self._events, []
        return ev
