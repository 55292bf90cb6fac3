import pytest
from pydantic import ValidationError

from kvgate.router.cost import CostModel, CostParams
from kvgate.router.types import ConversationId, FleetView, RouteRequest, WorkerId, WorkerView

P = CostParams(p0_ms=10, p1_ms=0.1, p2_ms=0, decode_ms=5, decode_ms_per_request=0, token_budget=1000,
               affinity_bonus_ms=1, load_epsilon=10, externality_weight=0)


def w(i: int, **kw: int) -> WorkerView:
    return WorkerView(WorkerId(f"w{i}"), "m", True, kw.pop("in_flight", 0), **kw)


def req(prompt: int, matched: dict[str, int] | None = None, home: str | None = None) -> RouteRequest:
    return RouteRequest("m", ConversationId("c"), WorkerId(home) if home else None, prompt_tokens=prompt,
                        matched_blocks={WorkerId(k): v for k, v in (matched or {}).items()}, block_size=16)


def test_cached_tokens_follow_vllm_rules() -> None:
    m = CostModel(P)
    assert m.cached_tokens(req(100, {"w0": 10}), w(0)) == 96  # whole blocks below the last token
    assert m.cached_tokens(req(160, {"w0": 10}), w(0)) == 144  # a full hit recomputes the last block


def test_prefers_the_cached_worker_when_idle() -> None:
    d = CostModel(P).pick(req(2000, {"w1": 100}), FleetView((w(0), w(1))))
    assert d is not None and d.worker == "w1" and d.reason == "longest_prefix" and d.expected_cached_tokens == 1600


def test_leaves_the_cached_worker_when_its_queue_costs_more() -> None:
    busy = w(1, pending_prefill_tokens=20000, pending_requests=3, in_flight=3)
    d = CostModel(P).pick(req(2000, {"w1": 100}), FleetView((w(0), busy)))
    assert d is not None and d.worker == "w0" and d.reason == "load_over_prefix"


def test_ttft_estimate_counts_passes_and_decode() -> None:
    m = CostModel(P)
    # 2,500 tokens ahead + 500 mine = 3 passes of <=1000: 3*10 + 3000*0.1, plus 3 decode steps of 5 ms.
    assert m.ttft_ms(req(500), w(0, pending_prefill_tokens=2500, decode_requests=2)) == pytest.approx(345)


def test_externality_pushes_big_requests_away_from_waiting_ones() -> None:
    greedy = CostModel(P)
    social = CostModel(P.model_copy(update={"externality_weight": 1.0}))
    waiting = w(0, pending_prefill_tokens=100, pending_requests=5, in_flight=5)
    other = w(1, pending_prefill_tokens=300, in_flight=1, pending_requests=1)
    r = req(800)
    assert greedy.pick(r, FleetView((waiting, other))).worker == "w0"  # type: ignore[union-attr]
    assert social.pick(r, FleetView((waiting, other))).worker == "w1"  # type: ignore[union-attr]


def test_affinity_breaks_ties_and_bounded_load_caps() -> None:
    m = CostModel(P)
    d = m.pick(req(100, home="w1"), FleetView((w(0), w(1))))
    assert d is not None and d.worker == "w1"
    capped = CostModel(P.model_copy(update={"load_epsilon": 0.0}))
    d = capped.pick(req(2000, {"w1": 100}), FleetView((w(0), w(1, in_flight=5))))
    assert d is not None and d.worker == "w0" and d.reason.endswith("_bounded")


def test_unhealthy_and_excluded_are_skipped() -> None:
    sick = WorkerView(WorkerId("w1"), "m", False, 0)
    d = CostModel(P).pick(req(100, {"w1": 5}), FleetView((w(0), sick)))
    assert d is not None and d.worker == "w0"
    assert CostModel(P).pick(req(100), FleetView((sick,))) is None


def test_params_are_validated() -> None:
    with pytest.raises(ValidationError):
        CostParams(token_budget=0)
    with pytest.raises(ValidationError):
        CostParams(unknown_knob=1)  # type: ignore[call-arg]
