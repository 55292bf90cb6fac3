from typing import Any

import pytest
from pydantic import ValidationError

from kvgate.router.cost import CostModel, CostParams
from kvgate.router.types import ConversationId, FleetView, RouteRequest, WorkerId, WorkerView

P = CostParams(p0_ms=10, p1_ms=0.1, p2_ms=0, decode_ms=5, decode_ms_per_request=0, token_budget=1000,
               affinity_bonus_ms=1, load_epsilon=10, externality_weight=0)


def w(i: int, **kw: Any) -> WorkerView:
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


def test_backlog_keeps_a_prefix_when_the_fleet_is_queued() -> None:
    busy_cached = w(1, pending_prefill_tokens=2500, pending_requests=2, in_flight=2)
    r = req(2000, {"w1": 100})  # 1,600 tokens cached on w1
    greedy = CostModel(P.model_copy(update={"backlog_weight": 0.0}))
    # Alone, w0 is faster for this request: 2 passes of 1,000 (220 ms) against 3 passes behind w1's queue (320).
    assert greedy.pick(r, FleetView((w(0), busy_cached))).worker == "w0"  # type: ignore[union-attr]
    # With a request waiting per worker, recomputing 1,600 tokens costs the fleet more than it saves here:
    # w0 220 + 1 x 0.1 x 2000 = 420 ms against w1 320 + 1 x 0.1 x 400 = 360 ms.
    m = CostModel(P)
    assert m.backlog_ms(r, w(0), 1.0) == pytest.approx(200) and m.backlog_ms(r, busy_cached, 1.0) == pytest.approx(40)
    d = m.pick(r, FleetView((w(0), busy_cached)))
    assert d is not None and d.worker == "w1" and d.reason == "longest_prefix"


def test_backlog_costs_nothing_while_no_one_waits() -> None:
    m = CostModel(P)
    assert m.backlog_ms(req(2000), w(0), 0.0) == 0
    idle = FleetView((w(0), w(1, in_flight=1, decode_requests=1)))
    scores = m.pick(req(2000, {"w1": 100}), idle).scores  # type: ignore[union-attr]
    assert scores[WorkerId("w0")] == pytest.approx(m.ttft_ms(req(2000, {"w1": 100}), w(0)))


def test_affinity_breaks_ties_and_bounded_load_caps() -> None:
    m = CostModel(P)
    d = m.pick(req(100, home="w1"), FleetView((w(0), w(1))))
    assert d is not None and d.worker == "w1"
    capped = CostModel(P.model_copy(update={"load_epsilon": 0.0}))
    d = capped.pick(req(2000, {"w1": 100}), FleetView((w(0), w(1, in_flight=5))))
    assert d is not None and d.worker == "w0" and d.bounded


def test_leaving_home_is_charged_only_for_the_prefix_the_new_worker_lacks() -> None:
    m = CostModel(P.model_copy(update={"affinity_cache_fraction": 1.0}))
    r = RouteRequest("m", ConversationId("c"), WorkerId("w0"), prompt_tokens=3000, block_size=16,
                     matched_blocks={WorkerId("w0"): 100, WorkerId("w1"): 150, WorkerId("w2"): 25})
    assert m.move_ms(r, w(0)) == -1  # the home's tie-breaker
    assert m.move_ms(r, w(1)) == 0  # w1 holds more than the home: nothing is lost by going there
    assert m.move_ms(r, w(2)) == pytest.approx(0.1 * (1600 - 400))  # w2 would recompute 1,200 home tokens
    # The home's stale claim does not keep the conversation from the worker with the longer prefix.
    d = m.pick(r, FleetView((w(0), w(1), w(2))))
    assert d is not None and d.worker == "w1" and d.reason == "longest_prefix"


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


# -- tiers and reservations -------------------------------------------------------------------------
T = P.model_copy(update={"kv_bytes_per_token": 100_000, "cpu_load_gbps": 10.0, "remote_load_gbps": 1.0,
                         "remote_rtt_ms": 2.0})


def tier_req(prompt: int, cpu: dict[str, int] | None = None, remote: int = 0,
             matched: dict[str, int] | None = None) -> RouteRequest:
    return RouteRequest("m", ConversationId("c"), None, prompt_tokens=prompt, block_size=16,
                        matched_blocks={WorkerId(k): v for k, v in (matched or {}).items()},
                        cpu_tokens=cpu or {}, remote_tokens=remote)


def test_tier_loads_are_priced_by_bandwidth() -> None:
    m = CostModel(T)
    r = m.reuse(tier_req(3000, {"n0": 2048}, remote=2560), w(0, node="n0"))
    assert (r.gpu, r.cpu, r.remote, r.tier) == (0, 2048, 512, "cpu")
    # 2048 tok x 100 kB at 10 GB/s = 20.48 ms; 512 tok at 1 GB/s = 51.2 ms + 2 ms round trip.
    assert m.load_ms(r) == pytest.approx(20.48 + 2 + 51.2)
    # What no tier covers is computed: 440 tokens in one pass.
    assert m.ttft_ms(tier_req(3000, {"n0": 2048}, remote=2560), w(0, node="n0")) == pytest.approx(
        10 + 0.1 * 440 + 73.68)


def test_the_node_with_the_cpu_copy_wins_and_says_so() -> None:
    fleet = FleetView((w(0, node="a"), w(1, node="b")))
    d = CostModel(T).pick(tier_req(4000, {"b": 3840}, remote=3840), fleet)
    assert d is not None and d.worker == "w1" and d.tier == "cpu" and d.reason == "longest_prefix"
    assert d.expected_cached_tokens == 3840 and d.expected_loaded_tokens == 3840


def test_remote_tier_serves_any_worker_instead_of_recompute() -> None:
    m = CostModel(T)
    cold = m.ttft_ms(tier_req(4000), w(0))
    remote = m.ttft_ms(tier_req(4000, remote=3840), w(0))
    assert remote < cold  # 3,840 tokens at 1 GB/s (384 ms) beat computing them (10 + 400 ms)
    d = m.pick(tier_req(4000, remote=3840), FleetView((w(0), w(1))))
    assert d is not None and d.tier == "remote" and d.reason == "longest_prefix"


def test_a_sync_load_is_charged_to_every_request_whose_step_waits_for_it() -> None:
    m = CostModel(T.model_copy(update={"externality_weight": 1.0}))
    busy = w(0, decode_requests=3, pending_requests=1)
    # 3,840 tokens from the remote tier: 2 + 384 ms, waited for by the 4 requests already there.
    assert m.load_stall_ms(tier_req(4000, remote=3840), busy) == pytest.approx(4 * 386)
    assert m.load_stall_ms(tier_req(4000, remote=3840), w(1)) == 0  # nobody there to wait
    assert m.load_stall_ms(tier_req(4000), busy) == 0  # nothing loaded: recompute is priced as prefill
    d = m.pick(tier_req(4000, remote=3840), FleetView((busy, w(1))))
    assert d is not None and d.worker == "w1"


def test_an_async_load_stalls_nobody_but_queues_on_the_channel() -> None:
    m = CostModel(T.model_copy(update={"externality_weight": 1.0, "tier_loads": "async"}))
    busy = w(0, decode_requests=3, pending_requests=1)
    r = tier_req(4000, remote=3840)
    assert m.load_stall_ms(r, busy) == 0
    backlog = w(0, load_backlog_ms=500.0)
    # The newcomer waits for the 500 ms of loads ahead of it, then its own 386.
    assert m.ttft_ms(r, backlog) == pytest.approx(m.ttft_ms(r, w(0)) + 500.0)
    assert m.ttft_ms(tier_req(4000), backlog) == m.ttft_ms(tier_req(4000), w(0))  # no load, no wait
    d = m.pick(r, FleetView((backlog, w(1))))
    assert d is not None and d.worker == "w1"
    # Sync mode has no channel queue to price: the loads are inside the steps.
    assert CostModel(T).ttft_ms(r, backlog) == CostModel(T).ttft_ms(r, w(0))


def test_reserved_kv_steers_newcomers_elsewhere() -> None:
    parked = w(0, reserved_tokens=60_000, kv_capacity_tokens=100_000)
    free = w(1, kv_capacity_tokens=100_000)
    m = CostModel(T)
    # 50k tokens fit in the 40k free only by evicting 10k of the parked sessions' KV.
    assert m.reservation_ms(tier_req(50_000), parked) == pytest.approx(0.1 * 10_000)
    assert m.reservation_ms(tier_req(30_000), parked) == 0
    d = m.pick(tier_req(50_000), FleetView((parked, free)))
    assert d is not None and d.worker == "w1"


def test_a_full_engine_is_charged_the_wait_for_a_running_slot() -> None:
    m = CostModel(P)
    full = w(0, in_flight=3, decode_requests=3, max_running=4, foreign_requests=1, service_ms=1000)
    free = w(1, in_flight=3, decode_requests=3, max_running=4, service_ms=1000)
    # 3 of this replica's and 1 of another's: the newcomer waits for 1 of 4 running to finish (~1000/5 ms).
    assert m.slot_wait_ms(full) == pytest.approx(200.0)
    assert m.slot_wait_ms(free) == 0.0 and m.slot_wait_ms(w(2, in_flight=9)) == 0.0  # cap or time unknown
    d = m.pick(req(300), FleetView((full, free)))
    assert d is not None and d.worker == "w1"  # cold: where a slot is free
    # A long prefix cached on the full one is worth the wait there (recomputing 8,000 tokens: ~800 ms).
    d = m.pick(req(8200, {"w0": 500}), FleetView((full, free)))
    assert d is not None and d.worker == "w0" and d.expected_cached_tokens == 8000
    off = CostModel(P.model_copy(update={"slot_wait_weight": 0.0}))
    assert off.slot_wait_ms(full) == 0.0
