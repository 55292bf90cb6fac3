"""SGLang's hierarchical cache (HiCache) on top of the simulated radix cache: a host-memory tier per worker,
as ``--enable-hierarchical-cache --hicache-write-policy write_through`` runs it (SGLang 0.5.23,
``mem_cache/unified_radix_cache.py``, ``unified_cache/unified_tree_core.py``).

Modelled after the source, not checked against it (its tree needs the cache controller's device streams):
- write-through: every node entering the tree is backed up to host (``write_through_threshold`` 1), its
  ``BlockStored`` with ``medium: "CPU_PINNED"`` published once the copy is acknowledged — here, in the
  batch after the GPU store; a backup that does not fit after evicting host-only leaves is skipped;
- device eviction demotes a backed-up leaf (``BlockRemoved`` GPU, the node stays, host-only) and deletes
  one that is not; host eviction drops host-only leaves, least recently used first (``BlockRemoved``
  ``CPU_PINNED``);
- a lookup returns the device prefix and, separately, the host-only continuation (``host_hit_length``),
  which the scheduler loads back before the prefill (``init_load_back``: ``BlockStored`` GPU), priced at
  the host-to-device bandwidth and counted in ``cached_tokens`` as SGLang counts it;
- a request that computed pages a host-only node holds re-attaches them on insert
  (``_unevict_node_on_insert``).
Not modelled: the storage tier (L3; ``kvstore/hicache_files.py`` probes a real one), write-back and
selective write-through, the load-back threshold.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvgate.router.hashing import BlockHash
from kvgate.sim.blockpool import BlockRemoved, BlockStored, KVEvent
from kvgate.sim.radixpool import RadixPool, _Node

HOST = "CPU_PINNED"


class HiCachePool(RadixPool):
    def __init__(self, num_blocks: int, block_size: int, host_blocks: int, *, kv_bytes_per_token: int = 131_072,
                 host_gbps: float = 20.0) -> None:
        super().__init__(num_blocks, block_size)
        if host_blocks < 1:
            raise ValueError("the host tier holds at least one page")
        self.host_blocks = host_blocks
        self.host_used = 0
        self.kv_bytes_per_token = kv_bytes_per_token
        self.host_gbps = host_gbps
        self._acks: list[_Node] = []
        """Backups whose host store is published with the next batch (SGLang's write-through ack)."""

    # -- lookups -------------------------------------------------------------------------------
    def host_hit(self, hashes: Sequence[BlockHash], start: int, max_blocks: int) -> int:
        node, idx = (self._root, -1) if start == 0 else self._where[hashes[start - 1]]
        if idx != len(node.hashes) - 1:
            return 0  # the device match ended inside a node: nothing below it continues the prompt
        now = next(self._clock)
        i = start
        while i < max_blocks:
            child = node.children.get(hashes[i])
            if child is None or child.on_device:
                break
            child.access = now
            k = 0
            while k < len(child.hashes) and i + k < max_blocks and child.hashes[k] == hashes[i + k]:
                k += 1
            if k < len(child.hashes):
                child = self._split(child, k)
            node, i = child, i + k
        return i - start

    def load_back(self, hashes: Sequence[BlockHash], pages: Sequence[int]) -> float:
        assert len(hashes) == len(pages)
        i = 0
        while i < len(hashes):
            node, k = self._where[hashes[i]]
            assert k == 0 and not node.on_device and len(node.hashes) <= len(hashes) - i, "host_hit splits nodes"
            self._attach(node, pages[i : i + len(node.hashes)])
            i += len(node.hashes)
        return len(pages) * self.block_size * self.kv_bytes_per_token / (self.host_gbps * 1e6)

    def _attach(self, node: _Node, pages: Sequence[int]) -> None:
        """Device pages for a host-only node (loaded back, or recomputed by a request)."""
        node.pages, node.on_device = list(pages), True
        for h, p in zip(node.hashes, pages, strict=True):
            self._page_hash[p] = h
            if self._refs.get(p, 0) == 0:
                self._n_evictable += 1
        parent = node.parent
        assert parent is not None
        self._enqueue(BlockStored(tuple(node.hashes), parent.hashes[-1] if parent.hashes else None,
                                  tuple(node.tokens), self.block_size, (node.salt,) if node.salt else None))

    # -- inserts -------------------------------------------------------------------------------
    def cache_blocks(self, block_ids: Sequence[int], hashes: Sequence[BlockHash], parent: BlockHash | None,
                     token_ids: Sequence[int], extra_keys: tuple[object, ...] | None = None) -> list[int]:
        self._unevict_on_insert(block_ids, hashes, parent)
        return super().cache_blocks(block_ids, hashes, parent, token_ids, extra_keys)

    def _unevict_on_insert(self, block_ids: Sequence[int], hashes: Sequence[BlockHash],
                           parent: BlockHash | None) -> None:
        node, idx = (self._root, -1) if parent is None else self._where[parent]
        i = 0
        while i < len(hashes):
            if idx < len(node.hashes) - 1:
                if node.hashes[idx + 1] != hashes[i]:
                    return
                idx, i = idx + 1, i + 1
                continue
            child = node.children.get(hashes[i])
            if child is None:
                return
            if not child.on_device:
                k = 0
                while k < len(child.hashes) and i + k < len(hashes) and child.hashes[k] == hashes[i + k]:
                    k += 1
                if k < len(child.hashes):
                    child = self._split(child, k)
                self._attach(child, block_ids[i : i + k])
            node, idx, i = child, 0, i + 1

    def _inserted(self, node: _Node) -> None:
        need = len(node.hashes)
        if self.host_blocks - self.host_used < need:
            self._evict_host(need - (self.host_blocks - self.host_used))
        if self.host_blocks - self.host_used >= need:
            node.host = True
            self.host_used += need
            self._acks.append(node)

    def _split(self, child: _Node, k: int) -> _Node:
        top = super()._split(child, k)
        if child in self._acks:  # both halves' host stores are still to be published, in path order
            self._acks.insert(self._acks.index(child), top)
        return top

    # -- evictions -----------------------------------------------------------------------------
    def _is_evictable_leaf(self, n: _Node) -> bool:
        return n.on_device and self._unlocked(n) and not any(c.on_device for c in n.children.values())

    def _evict_node(self, victim: _Node) -> int:
        if not victim.host:
            self._drop_host_subtree(victim)
            return super()._evict_node(victim)
        victim.on_device = False
        self._enqueue(BlockRemoved(tuple(victim.hashes)))
        return self._free_device_pages(victim)

    def _drop_host_subtree(self, n: _Node) -> None:
        for c in list(n.children.values()):
            self._drop_host_subtree(c)
            self._delete(c)
            self._drop_host(c)

    def _drop_host(self, n: _Node) -> None:
        if n.host:
            self.host_used -= len(n.hashes)
            n.host = False
            if n in self._acks:
                self._acks.remove(n)
            else:
                self._enqueue(BlockRemoved(tuple(n.hashes), HOST))

    def _evict_host(self, pages: int) -> None:
        freed = 0
        while freed < pages:
            leaves = [n for n in self._host_only() if not n.children]
            if not leaves:
                return
            victim = min(leaves, key=lambda n: n.access)
            self._delete(victim)
            freed += len(victim.hashes)
            self._drop_host(victim)

    def _host_only(self) -> list[_Node]:
        out, stack = [], list(self._root.children.values())
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            if not n.on_device:
                out.append(n)
        return out

    def reset(self) -> bool:
        if not super().reset():
            return False
        self.host_used = 0
        self._acks.clear()
        return True

    def take_events(self) -> list[KVEvent]:
        events = super().take_events()
        for n in self._acks:  # acknowledged now: published with the next batch
            parent = n.parent
            assert parent is not None
            self._enqueue(BlockStored(tuple(n.hashes), parent.hashes[-1] if parent.hashes else None,
                                      tuple(n.tokens), self.block_size, (n.salt,) if n.salt else None, HOST))
        self._acks.clear()
        return events

