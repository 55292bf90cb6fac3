from collections import Counter

from kvgate.router.cost import CostModel
from kvgate.router.policies import HashRing, LeastLoaded, PolicyParams, RoundRobin, SessionAffinity, make_policy
from kvgate.router.types import ConversationId, FleetView, RouteRequest, WorkerId, WorkerView


def fleet(*loads: int, unhealthy: tuple[int, ...] = ()) -> FleetView:
    return FleetView(tuple(WorkerView(WorkerId(f"w{i}"), "m", i not in unhealthy, load)
                           for i, load in enumerate(loads)))


def req(cid: str = "c1", home: str | None = None, exclude: tuple[str, ...] = ()) -> RouteRequest:
    return RouteRequest("m", ConversationId(cid), WorkerId(home) if home else None,
                        exclude=frozenset(WorkerId(e) for e in exclude))


def test_round_robin_rotates_over_healthy_workers() -> None:
    p = RoundRobin()
    f = fleet(0, 0, 0, unhealthy=(1,))
    picks = [p.pick(req(), f).worker for _ in range(4)]  # type: ignore[union-attr]
    assert picks == ["w0", "w2", "w0", "w2"]


def test_no_eligible_worker_gives_none() -> None:
    for p in (RoundRobin(), LeastLoaded(), SessionAffinity()):
        assert p.pick(req(), fleet(0, 0, unhealthy=(0, 1))) is None
        assert p.pick(req(exclude=("w0", "w1")), fleet(0, 0)) is None


def test_least_loaded_picks_minimum_and_breaks_ties_by_id() -> None:
    d = LeastLoaded().pick(req(), fleet(3, 1, 1))
    assert d is not None and d.worker == "w1" and d.reason == "min_load"


def test_affinity_stays_home_under_bound() -> None:
    d = SessionAffinity(epsilon=0.25).pick(req(home="w2"), fleet(1, 1, 1))
    assert d is not None and (d.worker, d.reason) == ("w2", "sticky")


def test_affinity_leaves_overloaded_home() -> None:
    # mean load with the new request = 8/3; cap = ceil(1.25 * 8/3) = 4; w2 at 6 is over it.
    d = SessionAffinity(epsilon=0.25).pick(req(home="w2"), fleet(0, 1, 6))
    assert d is not None and d.worker != "w2" and d.reason == "home_overloaded"


def test_affinity_leaves_unhealthy_home() -> None:
    d = SessionAffinity().pick(req(home="w1"), fleet(0, 0, 0, unhealthy=(1,)))
    assert d is not None and d.worker != "w1" and d.reason == "home_unavailable"


def test_new_sessions_follow_the_ring_and_spread() -> None:
    p = SessionAffinity(epsilon=10)  # no load bound in play
    f = fleet(0, 0, 0, 0)
    counts = Counter(p.pick(req(f"conv-{i}"), f).worker for i in range(2000))  # type: ignore[union-attr]
    assert set(counts) == {"w0", "w1", "w2", "w3"}
    assert max(counts.values()) < 2 * min(counts.values())
    again = p.pick(req("conv-7"), f)
    assert again is not None and again.worker == p.pick(req("conv-7"), f).worker  # type: ignore[union-attr]


def test_bounded_load_overflows_to_next_on_ring() -> None:
    p = SessionAffinity(epsilon=0.0)
    f0 = fleet(0, 0)
    first = p.pick(req("x"), f0)
    assert first is not None and first.reason == "ring"
    loads = [0, 0]
    loads[int(first.worker[1])] = 5
    d = p.pick(req("x"), fleet(*loads))
    assert d is not None and d.worker != first.worker and d.reason == "ring_overflow"


def test_ring_moves_only_removed_workers_keys() -> None:
    a = HashRing([WorkerId(f"w{i}") for i in range(5)])
    b = HashRing([WorkerId(f"w{i}") for i in range(4)])
    moved = sum(1 for i in range(3000) if a.walk(f"k{i}")[0] != b.walk(f"k{i}")[0])
    owned_by_w4 = sum(1 for i in range(3000) if a.walk(f"k{i}")[0] == "w4")
    assert moved == owned_by_w4


def test_make_policy_validates_name() -> None:
    p = make_policy("session_affinity", PolicyParams(affinity_epsilon=0.5))
    assert isinstance(p, SessionAffinity) and p.epsilon == 0.5
    assert isinstance(make_policy("cost_model"), CostModel)
    assert {make_policy(n).name for n in ("round_robin", "least_loaded", "session_affinity", "cost_model")} == {
        "round_robin", "least_loaded", "session_affinity", "cost_model"}
    try:
        make_policy("random")
    except ValueError as exc:
        assert "unknown policy" in str(exc)
    else:
        raise AssertionError("expected ValueError")


def test_dynamo_credits_price_each_tier_at_its_credit() -> None:
    from kvgate.router.policies import DynamoCredits

    p = DynamoCredits()
    ws = (WorkerView(WorkerId("w0"), "m", True, 0, node="n0"), WorkerView(WorkerId("w1"), "m", True, 0, node="n1"))
    # 1,024-token prompt in 16-token blocks (64 blocks); w0's node L1 holds 512 tokens, the pool 768.
    r = RouteRequest("m", ConversationId("c"), prompt_tokens=1024, block_size=16, cpu_tokens={"n0": 512},
                     remote_tokens=768)
    # w0: 32 host blocks x 0.75 + 16 pool blocks x 0.5 = 32 credit; w1: 48 pool blocks x 0.5 = 24.
    assert p.cost(r, ws[0]) == (64 - 32) + 64 and p.cost(r, ws[1]) == (64 - 24) + 64
    d = p.pick(r, FleetView(ws))
    assert d is not None and d.worker == "w0" and d.expected_cached_tokens == 768 and d.tier == "cpu"
    # A GPU hit counts whole; load (pending prefill, decoding context) is added block for block.
    busy = WorkerView(WorkerId("w0"), "m", True, 1, pending_prefill_tokens=1600, node="n0")
    gpu = RouteRequest("m", ConversationId("c"), prompt_tokens=1024, block_size=16,
                       matched_blocks={WorkerId("w0"): 63})
    assert p.cost(gpu, busy) == 100 + 64 - 63 + 64
    # 100 blocks queued outweigh 63 blocks of hit: an idle cold worker (128) beats it (165).
    assert p.pick(gpu, FleetView((busy, ws[1]))).worker == "w1"  # type: ignore[union-attr]
    assert make_policy("dynamo_credits").name == "dynamo_credits"


def test_dynamo_credits_spread_cold_conversations_reproducibly() -> None:
    from kvgate.router.policies import DynamoCredits

    f = FleetView(tuple(WorkerView(WorkerId(f"w{i}"), "m", True, 0) for i in range(4)))
    picks = [DynamoCredits().pick(RouteRequest("m", ConversationId(f"c{i}"), prompt_tokens=64), f)
             for i in range(40)]
    assert len({d.worker for d in picks if d}) == 4
    again = [DynamoCredits().pick(RouteRequest("m", ConversationId(f"c{i}"), prompt_tokens=64), f) for i in range(40)]
    assert [d.worker for d in picks if d] == [d.worker for d in again if d]
