"""The benchmark machinery: trace expansion, the virtual-time fleet and its settling of an instant, the
bounds, percentiles, spreads, the goodput search, the generated workloads."""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path

import pytest

from kvgate.bench.fleet import FleetSim
from kvgate.bench.goodput import search
from kvgate.bench.mooncake import DEFAULT_TRACE, windows
from kvgate.bench.report import Row, pct, table
from kvgate.bench.trace import (
    TraceRequest,
    TraceTokens,
    global_lru_reuse,
    load_mooncake,
    time_slice,
    unbounded_reuse,
    write_mooncake,
)
from kvgate.bench.workloads import AGENTIC, ChunkIds, SweParams, Trajectory, agentic_sessions, swe_sessions, to_trace
from kvgate.router.hashing import VllmHasher
from kvgate.sim.timing import get_profile


def synthetic() -> list[TraceRequest]:
    # Two conversations of three turns sharing a system chunk (0), 512-token chunks.
    out = []
    for turn in range(3):
        for conv in range(2):
            ids = (0, 100 * conv + 1, *range(100 * conv + 2, 100 * conv + 2 + 2 * turn))
            out.append(TraceRequest(len(out), float(len(out)), 512 * len(ids) - 100, 20, ids))
    return out


def test_trace_tokens_and_memoised_hashes() -> None:
    tt = TraceTokens(VllmHasher(64, seed="0"))
    r = synthetic()[4]
    toks = tt.tokens(r)
    assert len(toks) == r.input_length and toks[0] == 0 and toks[-1] == r.hash_ids[-1]
    assert tt.block_hashes(r) == VllmHasher(64, seed="0").block_hashes(toks)
    before = tt.hashed_blocks
    tt.block_hashes(synthetic()[4])
    assert tt.hashed_blocks == before  # memoised


def test_unbounded_reuse_counts_whole_shared_prefixes() -> None:
    tr = synthetic()
    # The first request of each conversation hits only the system chunk of the other (1 of 2 chunks), etc.
    expected_hits = 0 + 512 + (2 * 512) * 2 + (4 * 512) * 2
    total = sum(r.input_length for r in tr)
    assert unbounded_reuse(tr) == pytest.approx(expected_hits / total)


def test_global_lru_evicts_least_recent_and_tails_first() -> None:
    tr = synthetic()
    assert global_lru_reuse(tr, 1 << 30) == unbounded_reuse(tr)
    # Room for 3 chunks: turn 1 of conversation 0 finds its chunks evicted by conversation 1, but the
    # shared system chunk (touched last of every request, so most recent) stays.
    small = global_lru_reuse(tr, 3 * 512)
    assert 0 < small < unbounded_reuse(tr)
    only_root = [TraceRequest(0, 0.0, 1024, 1, (7, 8)), TraceRequest(1, 1.0, 1024, 1, (7, 9))]
    assert global_lru_reuse(only_root, 1024) == pytest.approx(512 / 2048)


def test_percentile_is_dynamos_nearest_rank() -> None:
    xs = [float(i) for i in range(100)]
    assert pct(xs, 0.99) == 98.0  # rank round(99 * 0.99) = 98; int(N * q) would say 99
    assert pct([4.0, 1.0, 3.0, 2.0], 0.5) == 3.0  # rank 1.5 rounds up, as Rust's f64::round does
    assert pct([5.0], 0.99) == 5.0


def test_same_timestamp_arrivals_share_an_idle_workers_first_step() -> None:
    prof = get_profile("dynamo-mocker")
    trace = [TraceRequest(i, 0.0, 2048, 4, (10 * i + 1, 10 * i + 2, 10 * i + 3, 10 * i + 4)) for i in range(3)]
    res = FleetSim(1, prof, "round_robin").run(trace)
    firsts = {r.first_token for r in res}
    assert len(firsts) == 1  # one 6,144-token pass, as Dynamo's replay settles the instant
    assert (res[0].first_token - res[0].arrival) * 1000 == pytest.approx(prof.prefill_ms([(6144, 0)]))  # type: ignore[operator]


def test_fleet_runs_every_request_waits_add_up_and_precise_beats_round_robin() -> None:
    trace = load_mooncake(Path(DEFAULT_TRACE), limit=400)
    prof = get_profile("dynamo-mocker")
    out = {}
    for mode in ("round_robin", "kvgate_precise", "kvgate_approx", "session_affinity"):
        sim = FleetSim(4, prof, mode, trace_waits=mode == "kvgate_precise")
        res = sim.run(trace)
        assert len(res) == 400 and all(r.first_token is not None and r.finish is not None for r in res)
        assert all(r.first_token >= r.arrival for r in res)  # type: ignore[operator]
        out[mode] = sum(r.cached for r in res) / sum(r.prompt for r in res)
        if mode == "kvgate_precise":
            # With events and no lag, the router's expectation is what the engine then reports.
            exact = sum(1 for r in res if r.cached == r.expected_cached)
            assert exact / len(res) > 0.95
            for r in res:
                assert r.wait is not None
                assert r.wait.total_ms == pytest.approx((r.first_token - r.arrival) * 1000, abs=1e-6)  # type: ignore[operator]
    assert out["kvgate_precise"] > out["round_robin"]
    assert out["kvgate_approx"] > out["round_robin"]


def test_time_slice_and_mooncake_round_trip(tmp_path: Path) -> None:
    tr = load_mooncake(Path(DEFAULT_TRACE), limit=300)
    half = time_slice(tr, 0.5, 1.0)
    assert half[0].arrival_s == 0 and [r.id for r in half] == list(range(len(half)))
    assert 0 < len(half) < len(tr) and half[-1].hash_ids == tr[-1].hash_ids
    back = load_mooncake(write_mooncake(half, tmp_path / "t.jsonl"))
    assert [(r.arrival_s, r.input_length, r.hash_ids) for r in back] == [
        (r.arrival_s, r.input_length, r.hash_ids) for r in half]


def test_windows_spread_and_reuse_only_rows() -> None:
    mean, p99 = windows([0.0, 1.0, 2.0, 3.0, 4.0, 5.0], [10.0, 10.0, 20.0, 20.0, 30.0, 30.0])
    assert (mean.low, mean.high, p99.low, p99.high) == (10.0, 30.0, 10.0, 30.0)
    text = table("t", [Row("bound", 0.5, reuse_only=True, bound=0.5), Row("x", 0.4, ttft_mean=1.0, bound=0.5)])
    assert "bound (reuse only) | 0.5000 | 1.000 | – |" in text and "| x | 0.4000 | 0.800 |" in text


def test_goodput_search_finds_the_last_speedup_under_the_slo() -> None:
    calls: list[float] = []

    def p99_at(s: float) -> float:
        calls.append(s)
        return 500.0 * s  # meets a 2 s SLO up to 4x

    best, runs = search(p99_at, 2000.0, refine=4)
    assert 3.6 < best <= 4.0 and runs == len(calls)
    assert search(lambda s: 5000.0, 2000.0, lo=0.25)[0] == 0.0


def test_chunk_ids_name_prefixes() -> None:
    ids = ChunkIds(chunk=4)
    a = ids.ids([("sys", 6), ("x", 3)])
    b = ids.ids([("sys", 6), ("y", 3)])
    c = ids.ids([("sys", 6), ("x", 2)])
    d = ids.ids([("sys", 6), ("x", 1)])
    assert a[0] == b[0] and a[1] != b[1]  # same first chunk, different second
    assert len(a) == 3 and a[:2] == c and len(c) == 2
    assert d[0] == a[0] and d[1] != a[1]  # a shorter last chunk is another block


def test_generated_workloads_are_valid_traces() -> None:
    trajs = [Trajectory("sys prompt " * 300, (("user", 900), ("assistant", 80), ("user", 300), ("assistant", 60)))]
    swe = to_trace(swe_sessions(SweParams(sessions=20, window_s=60.0), trajs))
    assert len(swe) == 40 and all(a.arrival_s <= b.arrival_s for a, b in pairwise(swe))
    assert len({r.hash_ids[0] for r in swe}) == 1  # the shared system prompt
    assert len({r.hash_ids[1] for r in swe}) == 20  # then each session's own task
    from dataclasses import replace

    ag = to_trace(agentic_sessions(replace(AGENTIC, sessions=6, seed=3)))
    assert ag and all(r.hash_ids and r.input_length > 0 and r.output_length > 0 for r in ag)
    assert unbounded_reuse(ag) > 0.5  # agent sessions resend their history


def test_tiered_fleet_modes_load_from_their_tiers_and_kvgate_reuses_at_least_gpu_only() -> None:
    from kvgate.bench.mooncake import fleet_tiers
    from kvgate.bench.workloads import agentic

    trace = sorted(agentic(7), key=lambda r: (r.arrival_s, r.id))[:200]
    prof = get_profile("dynamo-mocker").with_overrides(num_blocks=1024)  # 64k tokens a worker: it overflows
    reuse = {}
    for mode in ("kvgate_precise", "round_robin_pool", "dynamo_credits", "kvgate_tiers"):
        sim = FleetSim(4, prof, mode, tiers=fleet_tiers(4, prof))
        res = sim.run(trace)
        assert len(res) == 200 and all(r.first_token is not None for r in res)
        reuse[mode] = sum(r.cached for r in res) / sum(r.prompt for r in res)
        cpu = sum(e.stats.loaded_cpu_tokens for e in sim.engines)
        pool = sum(e.stats.loaded_remote_tokens for e in sim.engines)
        if mode == "kvgate_precise":
            assert sim.pool is None and cpu == pool == 0
        elif mode == "round_robin_pool":
            assert sim.l1 == {} and cpu == 0 and pool > 0
        else:
            assert cpu > 0
    assert reuse["kvgate_tiers"] >= reuse["kvgate_precise"]
    assert reuse["round_robin_pool"] > 0


def test_async_tiered_fleet_serves_every_request_and_waits_for_its_loads() -> None:
    from kvgate.bench.mooncake import fleet_tiers
    from kvgate.bench.workloads import agentic

    trace = sorted(agentic(7), key=lambda r: (r.arrival_s, r.id))[:200]
    prof = get_profile("dynamo-mocker").with_overrides(num_blocks=1024)
    ttft = {}
    for loads in (False, True):
        sim = FleetSim(4, prof, "round_robin_pool", tiers=fleet_tiers(4, prof, async_loads=loads))
        res = sim.run(trace)
        assert len(res) == 200 and all(r.first_token is not None and r.finish is not None for r in res)
        assert sum(e.stats.loaded_remote_tokens for e in sim.engines) > 0
        assert all(not e.channel for e in sim.engines)
        ttft[loads] = [(r.first_token - r.arrival) * 1000 for r in res]  # type: ignore[operator]
    assert ttft[True] != ttft[False]  # the mode changes the timing
    sim = FleetSim(4, prof, "kvgate_tiers", tiers=fleet_tiers(4, prof, async_loads=True))
    assert sim.cost.params.tier_loads == "async"
    sim.run(trace)
    assert max(a.load_free_at for a in sim.acct) > 0  # the router tracked the loads it sent


def test_only_tables_keeps_the_matching_workload_and_fleet() -> None:
    from kvgate.bench.mooncake import Workload, only_tables

    wls = [Workload("conversation", list), Workload("agentic sessions", list)]
    configs = [("8 workers × 1M tokens, 1× arrivals", 8, 1.0), ("4 workers × 1M tokens, 3× arrivals", 4, 3.0)]
    kept_w, kept_c = only_tables(wls, configs, "Agentic, 4 workers")
    assert [w.name for w in kept_w] == ["agentic sessions"] and kept_c == configs[1:]
    assert only_tables(wls, configs, "") == (wls, configs)
    with pytest.raises(ValueError):
        only_tables(wls, configs, "swe")
