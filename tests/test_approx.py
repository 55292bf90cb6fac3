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
