"""The simulated SGLang radix cache: page-aligned inserts, node splits, leaf-LRU eviction, coalesced events
(``tests/engine/test_sglang_parity.py`` checks the same behaviour event for event against SGLang's own
``RadixCache``)."""

from kvgate.router.sglang import SglangHasher
from kvgate.sim.blockpool import AllBlocksCleared, BlockRemoved, BlockStored
from kvgate.sim.engine import EngineCore, SimRequest
from kvgate.sim.kinds import SGLANG
from kvgate.sim.radixpool import RadixPool
from kvgate.sim.timing import TimingProfile

H = SglangHasher(2)
PROFILE = TimingProfile("t", "test", block_size=2, num_blocks=12, max_num_seqs=8, max_num_batched_tokens=64,
                        p1=0.01, d0=1.0)


def insert(pool: RadixPool, tokens: list[int], salt: str | None = None) -> list[int]:
    hs = H.block_hashes(tokens, cache_salt=salt)
    ids = pool.allocate(len(hs))
    assert ids is not None
    backing = pool.cache_blocks(ids, hs, None, tokens[: 2 * len(hs)], (salt,) if salt else None)
    pool.free(backing)
    return backing


def test_duplicates_share_pages_and_splits_link_parents() -> None:
    p = RadixPool(16, 2)
    a = insert(p, [1, 2, 3, 4, 5, 6, 7])  # three full pages; token 7 is never cached
    assert len(a) == 3 and p.take_events() == [BlockStored(tuple(H.block_hashes([1, 2, 3, 4, 5, 6])), None,
                                                           (1, 2, 3, 4, 5, 6), 2)]
    assert insert(p, [1, 2, 3, 4, 5, 6]) == a and p.take_events() == []  # the copy was freed at once
    insert(p, [1, 2, 9, 9])
    hs = H.block_hashes([1, 2, 9, 9])
    assert p.take_events() == [BlockStored((hs[1],), hs[0], (9, 9), 2)]
    assert p.num_free == 16  # every page is free or evictable


def test_eviction_takes_whole_lru_leaves_and_coalesces_removals() -> None:
    p = RadixPool(6, 2)
    insert(p, [1, 2, 3, 4])
    insert(p, [5, 6, 7, 8])
    insert(p, [1, 2, 9, 9])  # splits [1,2 | 3,4]; the [1,2] node is refreshed
    p.longest_hit(H.block_hashes([5, 6, 7, 8]), 2)  # [5..8] is now the most recent
    p.take_events()
    got = p.allocate(2)  # one page free: evicts the LRU leaf [3,4] (1 page) and nothing more
    assert got is not None
    evs = p.take_events()
    assert evs == [BlockRemoved((H.block_hashes([1, 2, 3, 4])[1],))]
    assert p.reset() is False  # a page is in use
    p.free(got)
    assert p.reset() and p.take_events() == [AllBlocksCleared()]


def test_sglang_core_caches_at_prefill_end_and_finish_not_while_decoding() -> None:
    c = EngineCore(PROFILE, H, kind=SGLANG)
    req = SimRequest("r", list(range(10, 17)), list(range(100, 106)))  # 7 prompt tokens, 6 generated
    c.add_request(req)
    stored: list[int] = []
    t = 0.0
    while c.has_work():
        plan = c.schedule()
        t += plan.duration_ms
        c.finish_step(plan, t)
        stored.append(sum(len(e.block_hashes) for e in c.take_events() if isinstance(e, BlockStored)))
    # Prefill stores the prompt's 3 full pages; decode stores nothing; the finish stores the pages that
    # prompt + output filled (12 tokens with KV -> 6 pages, 3 new).
    assert stored[0] == 3 and sum(stored[1:-1]) == 0 and stored[-1] == 3
    again = SimRequest("r2", list(range(10, 17)) + list(range(100, 105)) + [1, 2], [7])
    c.add_request(again)
    c.finish_step(c.schedule(), t)
    assert again.num_cached_tokens == 12


def test_make_core_builds_either_kind() -> None:
    from kvgate.router.sglang import event_int
    from kvgate.sim.engine import make_core

    s, v = make_core("sglang", PROFILE), make_core("vllm", PROFILE)
    assert s.kind is SGLANG and isinstance(s.hasher, SglangHasher) and s.kind.event_int is event_int
    assert v.kind.name == "vllm" and v.pool.num_blocks == 12 and s.pool.num_blocks == 12
