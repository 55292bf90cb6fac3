"""The simulated HiCache host tier: write-through backups published a batch later, demotion on device
eviction, host hits loaded back and counted as cached, host-only leaves evicted LRU, and kvgate's index
pricing what the CPU_PINNED events say."""

from kvgate.router.index import PrefixIndex
from kvgate.router.kvevents import KvEventState
from kvgate.router.residency import hicache_host_tokens
from kvgate.router.sglang import SglangHasher
from kvgate.router.types import WorkerId
from kvgate.sim.blockpool import BlockRemoved, BlockStored
from kvgate.sim.engine import EngineCore, SimRequest, make_core
from kvgate.sim.hicache import HOST, HiCachePool
from kvgate.sim.kinds import SGLANG, encode_batch
from kvgate.sim.timing import TimingProfile

H = SglangHasher(2)
PROFILE = TimingProfile("t", "test", block_size=2, num_blocks=10, max_num_seqs=4, max_num_batched_tokens=64,
                        p1=0.01, d0=1.0)


def insert(pool: HiCachePool, tokens: list[int]) -> None:
    hs = H.block_hashes(tokens)
    ids = pool.allocate(len(hs))
    assert ids is not None
    pool.free(pool.cache_blocks(ids, hs, None, tokens[: 2 * len(hs)]))


def test_write_through_then_demote_then_host_eviction() -> None:
    p = HiCachePool(4, 2, host_blocks=4)
    a, b = [1, 2, 3, 4], [5, 6, 7, 8]
    insert(p, a)
    ha = tuple(H.block_hashes(a))
    assert p.take_events() == [BlockStored(ha, None, tuple(a), 2)]
    assert p.take_events() == [BlockStored(ha, None, tuple(a), 2, None, HOST)]  # the ack, a batch later
    insert(p, b)
    p.take_events()
    p.take_events()
    got = p.allocate(2)  # the device is full: the LRU leaf (a) is demoted, still on host
    assert got is not None and p.take_events() == [BlockRemoved(ha)]
    assert p.longest_hit(list(ha), 2) == [] and p.host_hit(list(ha), 0, 2) == 2
    p.free(got)
    insert(p, [9, 9, 8, 8])  # a third chain: the host is full, so the host-only leaf (a) goes
    evs = p.take_events()
    assert BlockRemoved(ha, HOST) in evs and p.host_hit(list(ha), 0, 2) == 0


def run(core: EngineCore, req: SimRequest) -> list[object]:
    core.add_request(req)
    t, evs = 0.0, []
    while core.has_work():
        plan = core.schedule()
        t += plan.duration_ms
        core.finish_step(plan, t)
        evs += core.take_events()
    return evs


def test_host_hits_are_loaded_back_and_counted_as_cached() -> None:
    core = make_core("sglang", PROFILE, hicache_ratio=4.0)
    assert isinstance(core.pool, HiCachePool) and core.pool.host_blocks == 40
    conv = list(range(100, 112))  # 6 pages
    run(core, SimRequest("a", conv, [1]))
    for i in range(3):  # other prompts push the conversation off the 10-page device
        run(core, SimRequest(f"o{i}", list(range(200 + 20 * i, 214 + 20 * i)), [1]))
    assert core.pool.longest_hit(core.hasher.block_hashes(conv), 6) == []
    again = SimRequest("a2", [*conv, 5, 6, 7], [1])
    evs = run(core, again)
    assert again.num_cached_tokens == 12 and core.stats.loaded_cpu_tokens == 12 and core.stats.load_ms > 0
    loaded = [e for e in evs if isinstance(e, BlockStored) and e.medium == "GPU"]
    assert sum(len(e.block_hashes) for e in loaded) >= 6


def test_index_prices_what_cpu_pinned_events_say() -> None:
    core = make_core("sglang", PROFILE, hicache_ratio=2.0)
    state = KvEventState(PrefixIndex())
    w = WorkerId("sgl")
    state.add_worker(w)
    conv = list(range(100, 112))
    evs = run(core, SimRequest("a", conv, [1]))
    evs += core.take_events()  # the acks of the last batch
    state.on_message(w, 0, encode_batch(SGLANG, evs, 0.0))  # type: ignore[arg-type]
    ids = core.kind.event_int
    hashes = [ids(h) for h in core.hasher.block_hashes([*conv, 9, 9])]
    assert hicache_host_tokens(state.index, {w: hashes}, {w: 2}) == {"sgl": 12}


def test_hicache_is_sglangs_only() -> None:
    import pytest

    with pytest.raises(ValueError):
        make_core("vllm", PROFILE, hicache_ratio=1.0)


def test_chained_host_stores_merge_and_stay_on_host() -> None:
    # Two acknowledged backups of one chain go out as one event; it must still say CPU_PINNED, or kvgate
    # would take host pages for device pages.
    p = HiCachePool(8, 2, host_blocks=8)
    a = [1, 2, 3, 4]
    ha = tuple(H.block_hashes(a))
    p._enqueue(BlockStored(ha[:1], None, tuple(a[:2]), 2, None, HOST))
    p._enqueue(BlockStored(ha[1:], ha[0], tuple(a[2:]), 2, None, HOST))
    assert p.take_events() == [BlockStored(ha, None, tuple(a), 2, None, HOST)]
