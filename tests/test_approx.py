from kvgate.router.approx import ApproxIndex
from kvgate.router.types import WorkerId

W = WorkerId("w")


def test_routed_prompts_expire_after_ttl_unless_routed_again() -> None:
    a = ApproxIndex(ttl_s=10)
    a.record(W, [1, 2, 3], now=0)
    a.record(W, [1, 2], now=8)  # the conversation came back: its prefix stays warm
    assert a.match([1, 2, 3], now=5) == {W: 3}
    assert a.match([1, 2, 3], now=12) == {W: 2}
    assert a.match([1, 2, 3], now=19) == {}


def test_a_worker_holds_no_more_blocks_than_its_capacity_least_recently_routed_out_first() -> None:
    from kvgate.router.approx import ApproxIndex
    from kvgate.router.types import WorkerId

    w = WorkerId("w")
    idx = ApproxIndex(ttl_s=120.0, capacity=lambda _: 10)
    idx.record(w, list(range(1, 9)), now=0.0)      # blocks 1..8
    idx.record(w, [1, 2], now=1.0)                  # 1, 2 routed again: the youngest now
    idx.record(w, list(range(100, 106)), now=2.0)   # six more: 3..6 go, the oldest routed
    assert idx.match([1, 2], now=3.0) == {w: 2}
    assert idx.match([3], now=3.0) == {} and idx.match([7, 8], now=3.0) == {w: 2}
    assert idx.match(list(range(100, 106)), now=3.0) == {w: 6}
    assert sum(len(v) for v in idx._latest.values()) == 10
    unbounded = ApproxIndex(ttl_s=120.0, capacity=lambda _: 0)
    unbounded.record(w, list(range(1000)), now=0.0)
    assert unbounded.match(list(range(1000)), now=1.0) == {w: 1000}
