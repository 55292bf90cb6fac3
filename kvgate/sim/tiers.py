"""LMCache's tiers as the simulated engine sees them: a CPU pool per node (L1) and a shared remote pool
(L2, Redis), both LRU over 256-token chunks.

A chunk is named by the engine's block hash at its last block, which names the whole prefix up to it
(LMCache's own keys are a rolling hash over the same prefix, see ``router/hashing.LMCacheKeys``; the
identity is the same, only the function differs). As LMCache 0.5.6's multiprocess server does
(docs/tiering.md has the source lines): store-on-compute writes every complete chunk of a *prompt* to
L1 and at once through to L2 (generated tokens only with ``save_decode_cache``); a lookup walks chunks
from the start and stops at the first one neither tier holds; what a lookup loads from L2 is *not*
kept in L1 — only an explicit prefetch (``POST /cache/prefetches``) retains it there.

A shared pool (vLLM + Mooncake store: every worker writes the prefix KV it computes to one pool of the
fleet's host memory, any worker loads it) is the same L2 with the pool's rates and no L1 (``cpu=None``);
``FleetTiers`` has the sizes and rates and where they come from.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvgate.router.hashing import BlockHash


def chunk_keys(hashes: Sequence[BlockHash], block_size: int, chunk_tokens: int) -> list[BlockHash]:
    """The key of every full chunk covered by ``hashes`` (one per block): the hash of its last block."""
    per = chunk_tokens // block_size
    return [hashes[i] for i in range(per - 1, len(hashes), per)]


class TierPool:
    """An LRU of chunk keys; ``capacity`` in chunks, None for unbounded."""

    def __init__(self, name: str, capacity: int | None) -> None:
        if capacity is not None and capacity < 1:
            raise ValueError("a tier holds at least one chunk")
        self.name = name
        self.capacity = capacity
        self._keys: OrderedDict[BlockHash, None] = OrderedDict()
        self.stored = 0
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: BlockHash) -> bool:
        return key in self._keys

    def put(self, keys: Iterable[BlockHash]) -> None:
        for k in keys:
            if k in self._keys:
                self._keys.move_to_end(k)
                continue
            self._keys[k] = None
            self.stored += 1
            if self.capacity is not None and len(self._keys) > self.capacity:
                self._keys.popitem(last=False)
                self.evicted += 1

    def leading(self, keys: Iterable[BlockHash]) -> int:
        """How many of ``keys``, from the first, this tier holds (the prefix it can serve, in chunks)."""
        n = 0
        for k in keys:
            if k not in self._keys:
                break
            n += 1
        return n

    def touch(self, keys: Iterable[BlockHash]) -> None:
        for k in keys:
            if k in self._keys:
                self._keys.move_to_end(k)


@dataclass(slots=True)
class EngineTiers:
    """One engine's view: its node's L1 (None: a pool-only engine), the fleet's L2 or shared pool
    (optional), and what a load costs."""

    cpu: TierPool | None
    remote: TierPool | None
    chunk_tokens: int = 256
    kv_bytes_per_token: int = 131_072
    cpu_gbps: float = 20.0
    remote_gbps: float = 2.5
    remote_rtt_ms: float = 1.0
    save_decode: bool = False
    """LMCache's ``save_decode_cache``: also store chunks of generated tokens."""
    async_loads: bool = False
    """LMCache's ``enable_async_loading`` (default False in LMCache's ``v1/config.py``): a request whose
    prefix comes from a tier waits for its load with its blocks allocated while the rest of the batch
    keeps stepping (vLLM's ``load_kv_async`` / ``WAITING_FOR_REMOTE_KVS``), instead of the step that
    admits it waiting for the load (``sim/engine.py``)."""

    def chunk_keys(self, hashes: Sequence[BlockHash], block_size: int) -> list[BlockHash]:
        return chunk_keys(hashes, block_size, self.chunk_tokens)

    def lookup(self, keys: Sequence[BlockHash]) -> list[str]:
        """Where each leading chunk is (``cpu`` or ``remote``), up to the first one no tier holds."""
        out: list[str] = []
        for k in keys:
            if self.cpu is not None and k in self.cpu:
                out.append("cpu")
            elif self.remote is not None and k in self.remote:
                out.append("remote")
            else:
                break
        return out

    def retrieve(self, keys: Sequence[BlockHash]) -> None:
        """A load: refresh what L1 served and what L2 served, without copying L2's into L1."""
        if self.cpu is not None:
            self.cpu.touch(keys)
        if self.remote is not None:
            self.remote.touch(keys)

    def prefetch(self, keys: Sequence[BlockHash]) -> int:
        """Warm L1 from L2 (kept there); returns the chunks copied."""
        if self.remote is None or self.cpu is None:
            return 0
        missing = [k for k in keys if k not in self.cpu and k in self.remote]
        self.cpu.put(missing)
        return len(missing)

    def store(self, keys: Sequence[BlockHash]) -> None:
        if self.cpu is not None:
            self.cpu.put(keys)
        if self.remote is not None:
            self.remote.put(keys)

    def load_ms(self, cpu_chunks: int, remote_chunks: int) -> float:
        ms = cpu_chunks * self.chunk_tokens * self.kv_bytes_per_token / (self.cpu_gbps * 1e6)
        if remote_chunks:
            ms += self.remote_rtt_ms + remote_chunks * self.chunk_tokens * self.kv_bytes_per_token / (
                self.remote_gbps * 1e6)
        return ms


MOONCAKE_POOL_GBPS = 20.0
"""A shared pool's load rate into one worker: Mooncake's Transfer Engine moves 87 GB/s over 4 × 200 Gbps
RoCE NICs (its published benchmark, ~22 GB/s a NIC), so one NIC per GPU gives ~20 GB/s — as fast as the
node's own PCIe copy. Generous to the pool: a third-party vLLM MooncakeConnector microbenchmark measured
5–7 GB/s effective. The baseline gets the fast number so that a router that beats it beats it anyway."""
MOONCAKE_POOL_RTT_MS = 0.5
"""One Get: a metadata lookup at the store's master plus the RDMA read setup (A: sub-millisecond)."""


@dataclass(frozen=True, slots=True)
class FleetTiers:
    """A tiered fleet for the replay benchmarks: per node an L1 of ``cpu_tokens_per_node`` (0: none) and
    one shared pool of ``pool_tokens`` (None: unbounded) that every computed prompt chunk is written
    through to. Loads cost ``kv_bytes_per_token`` over the tier's rate (plus one round trip from the pool)."""

    workers_per_node: int = 2
    cpu_tokens_per_node: int = 2 * 1_048_576
    """Each worker's share of its node's L1 as large as its GPU KV (A: host DRAM ≥ HBM on GPU servers)."""
    pool_tokens: int | None = None
    chunk_tokens: int = 256
    kv_bytes_per_token: int = 131_072
    cpu_gbps: float = 20.0
    pool_gbps: float = MOONCAKE_POOL_GBPS
    pool_rtt_ms: float = MOONCAKE_POOL_RTT_MS
    async_loads: bool = False
    """The engines load asynchronously (``EngineTiers.async_loads``)."""

    def node_of(self, worker: int) -> str:
        return f"node{worker // self.workers_per_node}"

    def pools(self, n_workers: int) -> tuple[dict[str, TierPool], TierPool]:
        """Fresh tiers for a fleet of ``n_workers``: the nodes' L1s (none when ``cpu_tokens_per_node``
        is 0) and the shared pool."""
        nodes = sorted({self.node_of(i) for i in range(n_workers)})
        per = self.chunk_tokens
        cpu = ({n: TierPool(f"cpu:{n}", self.cpu_tokens_per_node // per) for n in nodes}
               if self.cpu_tokens_per_node else {})
        return cpu, TierPool("pool", None if self.pool_tokens is None else self.pool_tokens // per)

    def engine_tiers(self, worker: int, cpu: dict[str, TierPool], pool: TierPool) -> EngineTiers:
        return EngineTiers(cpu.get(self.node_of(worker)), pool, self.chunk_tokens, self.kv_bytes_per_token,
                           self.cpu_gbps, self.pool_gbps, self.pool_rtt_ms, async_loads=self.async_loads)
