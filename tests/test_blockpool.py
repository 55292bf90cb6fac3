from kvgate.router.hashing import BlockHash
from kvgate.sim.blockpool import AllBlocksCleared, BlockPool, BlockRemoved, BlockStored


def h(i: int) -> BlockHash:
    return BlockHash(bytes([i]) * 32)


def test_hits_stop_at_first_miss_and_respect_max() -> None:
    p = BlockPool(num_blocks=9, block_size=2)
    blocks = p.allocate(3)
    assert blocks is not None
    p.cache_blocks(blocks, [h(1), h(2), h(3)], None, [0] * 6)
    assert p.longest_hit([h(1), h(2), h(9), h(3)], 10) == blocks[:2]
    assert p.longest_hit([h(1), h(2), h(3)], 1) == blocks[:1]


def test_freed_blocks_stay_cached_and_tail_is_evicted_first() -> None:
    p = BlockPool(num_blocks=5, block_size=2)
    a = p.allocate(3)
    assert a is not None
    p.cache_blocks(a, [h(1), h(2), h(3)], None, [0] * 6)
    p.take_events()
    p.free(a)
    assert p.usage() == 0.0 and p.is_cached(h(1))
    # The free queue now holds: the never-used block, then a's blocks tail first (h3, h2, h1).
    got = p.allocate(2)
    assert got is not None
    assert p.take_events() == [BlockRemoved((h(3),))]
    got2 = p.allocate(1)
    assert got2 is not None
    assert p.take_events() == [BlockRemoved((h(2),))]
    assert p.is_cached(h(1))


def test_touch_pulls_hit_blocks_out_of_free_queue() -> None:
    p = BlockPool(num_blocks=3, block_size=2)
    a = p.allocate(2)
    assert a is not None
    p.cache_blocks(a, [h(1), h(2)], None, [0] * 4)
    p.free(a)
    p.touch(a[:1])
    assert p.num_free == 1
    assert p.allocate(2) is None  # only one free block left
    got = p.allocate(1)
    assert got == [a[1]]


def test_stored_event_carries_parent_and_tokens() -> None:
    p = BlockPool(num_blocks=5, block_size=2)
    a = p.allocate(2)
    assert a is not None
    p.cache_blocks(a[:1], [h(1)], None, [7, 8], extra_keys=("salt",))
    p.cache_blocks(a[1:], [h(2)], h(1), [9, 10], extra_keys=("salt",))
    assert p.take_events() == [
        BlockStored((h(1),), None, (7, 8), 2, ("salt",)),
        BlockStored((h(2),), h(1), (9, 10), 2, None),
    ]


def test_duplicate_hash_is_kept_once_and_events_stay_consistent() -> None:
    p = BlockPool(num_blocks=7, block_size=1)
    a = p.allocate(3)
    b = p.allocate(3)
    assert a is not None and b is not None
    p.cache_blocks(a[:1], [h(2)], h(1), [2])
    p.take_events()
    p.cache_blocks(b, [h(1), h(2), h(3)], None, [1, 2, 3])
    assert p.take_events() == [BlockStored((h(1),), None, (1,), 1), BlockStored((h(3),), h(2), (3,), 1)]


def test_reset_refused_while_referenced() -> None:
    p = BlockPool(num_blocks=3, block_size=2)
    a = p.allocate(1)
    assert a is not None
    p.cache_blocks(a, [h(1)], None, [0, 0])
    assert not p.reset()
    p.free(a)
    assert p.reset() and not p.is_cached(h(1))
    assert p.take_events()[-1] == AllBlocksCleared()
