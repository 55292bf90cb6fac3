"""LMCache tiers in the simulated engine: store-on-compute, loads, retention, prefetch; background priority."""

from __future__ import annotations

from kvgate.router.hashing import VllmHasher
from kvgate.sim.engine import EngineCore, SimRequest
from kvgate.sim.tiers import EngineTiers, TierPool
from kvgate.sim.timing import TimingProfile
from tests.helpers import run

# 4-token blocks, 8-token chunks (2 blocks), a 16-block GPU.
PROFILE = TimingProfile(name="t", source="test", block_size=4, num_blocks=17, max_num_seqs=8,
                        max_num_batched_tokens=64, p0=1.0, p1=0.1, d0=1.0)


def engine(cpu: TierPool, remote: TierPool | None, blocks: int = 17) -> EngineCore:
    tiers = EngineTiers(cpu, remote, chunk_tokens=8, kv_bytes_per_token=1000, cpu_gbps=1.0, remote_gbps=0.1,
                        remote_rtt_ms=5.0)
    return EngineCore(PROFILE, VllmHasher(4, seed="0"), num_blocks=blocks, tiers=tiers)


def test_prompt_chunks_are_stored_and_an_evicted_prompt_loads_from_cpu() -> None:
    cpu, remote = TierPool("cpu", None), TierPool("remote", None)
    c = engine(cpu, remote)
    a = SimRequest("a", list(range(30)), [1, 2])
    c.add_request(a)
    run(c)
    assert len(cpu) == 3 and len(remote) == 3  # full 8-token chunks of the 30-token prompt, not the output
    c.add_request(SimRequest("x", list(range(100, 160)), [1]))  # 15 blocks: evicts a's cached blocks
    run(c)
    c.add_request(SimRequest("y", list(range(200, 260)), [1]))
    run(c)
    assert not c.pool.longest_hit(c.hasher.block_hashes(list(range(30))), 7)  # a's KV is gone from the GPU
    b = SimRequest("b", [*range(30), 7, 7], [1])
    c.add_request(b)
    plan = c.schedule()
    assert b.num_cached_tokens == 24 and b.external_tokens == 24  # three chunks loaded, nothing on GPU
    # 24 tokens x 1000 B at 1 GB/s = 0.024 ms on top of computing the 8 others.
    assert abs(plan.duration_ms - (1.0 + 0.1 * 8 + 0.024)) < 1e-9
    assert c.stats.loaded_cpu_tokens == 24 and c.stats.loaded_remote_tokens == 0


def test_remote_loads_are_not_kept_in_cpu_but_a_prefetch_is() -> None:
    cpu, remote = TierPool("cpu", None), TierPool("remote", None)
    c = engine(cpu, remote)
    c.add_request(SimRequest("a", list(range(30)), [1]))
    run(c)
    keys = c.tiers.chunk_keys(c.hasher.block_hashes(list(range(30))), 4)  # type: ignore[union-attr]
    cpu._keys.clear()  # the node's L1 lost them; Redis still has them
    other = engine(TierPool("cpu2", None), remote)
    b = SimRequest("b", list(range(30)), [1])
    other.add_request(b)
    run(other)
    assert b.external_tokens == 24 and other.stats.loaded_remote_tokens == 24
    assert len(other.tiers.cpu) == 0  # type: ignore[union-attr]
    assert other.tiers.prefetch(keys) == 3 and all(k in other.tiers.cpu for k in keys)  # type: ignore[union-attr, operator]


def test_cpu_tier_is_lru_bounded() -> None:
    pool = TierPool("cpu", 2)
    pool.put([b"a", b"b"])
    pool.touch([b"a"])
    pool.put([b"c"])
    assert b"a" in pool and b"c" in pool and b"b" not in pool and pool.evicted == 1


def test_background_prefill_waits_for_foreground_prefill() -> None:
    c = EngineCore(PROFILE, VllmHasher(4, seed="0"), num_blocks=64, background_chunk=8)
    bg = SimRequest("bg", list(range(40)), [1], background=True)
    fg = SimRequest("fg", list(range(100, 120)), [1, 2, 3])
    c.add_request(bg)
    c.add_request(fg)
    first = c.schedule()
    assert [s.request.id for s in first.scheduled] == ["fg"]
    c.finish_step(first, 1.0)
    second = c.schedule()  # fg decodes now: the background prefill may run, 8 tokens at a time
    assert {s.request.id: s.num_new for s in second.scheduled} == {"fg": 1, "bg": 8}
    run(c)
    assert bg.generated == 1 and fg.generated == 3


def test_a_paused_background_prefill_yields_its_memory_to_a_user() -> None:
    small = TimingProfile(name="t", source="test", block_size=4, num_blocks=41, max_num_seqs=8,
                          max_num_batched_tokens=128, p0=1.0, p1=0.1, d0=1.0)
    c = EngineCore(small, VllmHasher(4, seed="0"), background_chunk=128)
    bg = SimRequest("bg", list(range(150)), [1], background=True)
    c.add_request(bg)
    c.finish_step(c.schedule(), 1.0)  # 128 of its tokens computed: 32 of the 40 blocks held
    fg = SimRequest("fg", list(range(1000, 1100)), [1, 2])
    c.add_request(fg)
    run(c, 1.0)  # the user's 25 blocks do not fit beside it: the background request is preempted
    assert fg.generated == 2 and bg.generated == 1 and c.stats.preemptions >= 1


def test_a_pool_only_engine_stores_through_to_the_pool_and_loads_from_it() -> None:
    # vLLM + Mooncake store: no L1, every computed prompt chunk written to the shared pool.
    pool = TierPool("pool", None)
    tiers = EngineTiers(None, pool, chunk_tokens=8, kv_bytes_per_token=1000, cpu_gbps=1.0, remote_gbps=0.1,
                        remote_rtt_ms=5.0)
    c = EngineCore(PROFILE, VllmHasher(4, seed="0"), num_blocks=17, tiers=tiers)
    c.add_request(SimRequest("a", list(range(30)), [1, 2]))
    run(c)
    assert len(pool) == 3
    assert tiers.prefetch(tiers.chunk_keys(c.hasher.block_hashes(list(range(30))), 4)) == 0  # no L1 to warm
    # Another engine of the fleet loads it: 24 tokens x 1000 B at 0.1 GB/s + one 5 ms round trip.
    other = EngineCore(PROFILE, VllmHasher(4, seed="0"), num_blocks=17, tiers=tiers)
    b = SimRequest("b", [*range(30), 7, 7], [1])
    other.add_request(b)
    plan = other.schedule()
    assert b.external_tokens == 24 and other.stats.loaded_remote_tokens == 24 and other.stats.loaded_cpu_tokens == 0
    assert abs(plan.duration_ms - (1.0 + 0.1 * 8 + 5.0 + 0.24)) < 1e-9


def test_fleet_tiers_give_each_node_an_l1_and_the_round_robin_fleet_their_memory_in_its_pool() -> None:
    from kvgate.bench.fleet import pool_only
    from kvgate.sim.tiers import FleetTiers

    t = FleetTiers(workers_per_node=2, cpu_tokens_per_node=1024, pool_tokens=2048, chunk_tokens=256)
    cpu, pool = t.pools(4)
    assert sorted(cpu) == ["node0", "node1"] and cpu["node0"].capacity == 4 and pool.capacity == 8
    e0, e3 = t.engine_tiers(0, cpu, pool), t.engine_tiers(3, cpu, pool)
    assert e0.cpu is cpu["node0"] and e3.cpu is cpu["node1"] and e0.remote is e3.remote is pool
    rr = pool_only(t, 4)
    assert rr.cpu_tokens_per_node == 0 and rr.pool_tokens == 2048 + 2 * 1024
    cpu, pool = rr.pools(4)
    assert cpu == {} and t.engine_tiers(1, cpu, pool).cpu is None
