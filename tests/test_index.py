import time

from kvgate.router.index import PrefixIndex, tier_of
from kvgate.router.types import WorkerId

A, B, C = WorkerId("a"), WorkerId("b"), WorkerId("c")


def test_longest_prefix_per_worker() -> None:
    ix = PrefixIndex()
    ix.store(A, [1, 2, 3, 4])
    ix.store(B, [1, 2, 9])
    ix.store(C, [5])
    assert ix.match([1, 2, 3, 4, 5]) == {A: 4, B: 2}
    assert ix.match([5, 1]) == {C: 1}
    assert ix.match([]) == {}
    assert ix.match([1, 2], workers=[B]) == {B: 2}


def test_a_hole_ends_the_prefix() -> None:
    ix = PrefixIndex()
    ix.store(A, [1, 3, 4])  # block 2 evicted: 3 and 4 are unreachable as a prefix
    assert ix.match([1, 2, 3, 4]) == {A: 1}


def test_remove_clear_and_drop_keep_the_index_consistent() -> None:
    ix = PrefixIndex()
    ix.store(A, [1, 2, 3])
    ix.store(B, [1, 2])
    assert ix.remove(A, [3, 99]) == 1  # unknown hashes are ignored
    assert ix.match([1, 2, 3]) == {A: 2, B: 2}
    assert ix.clear(B) == 2
    assert ix.match([1, 2]) == {A: 2}
    ix.drop_worker(A)
    assert ix.match([1]) == {} and ix.block_count() == 0
    ix.store(C, [1])  # a freed bit is reused without leaking old entries
    assert ix.match([1]) == {C: 1}


def test_tiers_are_separate() -> None:
    ix = PrefixIndex()
    ix.store(A, [1, 2], tier="CPU")
    assert ix.match([1, 2]) == {} and ix.match([1, 2], tier="CPU") == {A: 2}
    assert tier_of(None) == "GPU" and tier_of("CPU") == "CPU" and tier_of("disk") is None


def test_match_cost_follows_matched_blocks_not_index_size() -> None:
    ix = PrefixIndex()
    for w in range(8):
        ix.store(WorkerId(f"w{w}"), range(w * 100_000, w * 100_000 + 50_000))
    probe = list(range(10)) + [-1] * 5000  # 10 matching blocks, then a miss
    t0 = time.perf_counter()
    for _ in range(200):
        assert ix.match(probe) == {WorkerId("w0"): 10}
    assert time.perf_counter() - t0 < 5  # generous: the walk stops at the first miss, not at 5010
