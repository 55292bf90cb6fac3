"""The benchmark machinery: trace expansion, the virtual-time fleet, the oracle."""

from __future__ import annotations

from pathlib import Path

from kvgate.bench.fleet import FleetSim
from kvgate.bench.mooncake import DEFAULT_TRACE, oracle_reuse
from kvgate.bench.trace import TraceRequest, TraceTokens, load_mooncake
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


def test_oracle_counts_whole_shared_prefixes() -> None:
    tr = synthetic()
    # The first request of each conversation hits only the system chunk of the other (1 of 2 chunks), etc.
    expected_hits = 0 + 512 + (2 * 512) * 2 + (4 * 512) * 2
    total = sum(r.input_length for r in tr)
    assert abs(oracle_reuse(tr) - min(1.0, expected_hits / total)) < 0.02


def test_fleet_runs_every_request_and_precise_beats_round_robin() -> None:
    trace = load_mooncake(Path(DEFAULT_TRACE), limit=400)
    prof = get_profile("dynamo-mocker")
    out = {}
    for mode in ("round_robin", "kvgate_precise", "kvgate_approx", "session_affinity"):
        sim = FleetSim(4, prof, mode)
        res = sim.run(trace)
        assert len(res) == 400 and all(r.first_token is not None and r.finish is not None for r in res)
        assert all(r.first_token >= r.arrival for r in res)  # type: ignore[operator]
        out[mode] = sum(r.cached for r in res) / sum(r.prompt for r in res)
        if mode == "kvgate_precise":
            # With events and no lag, the router's expectation is what the engine then reports.
            exact = sum(1 for r in res if r.cached == r.expected_cached)
            assert exact / len(res) > 0.95
    assert out["kvgate_precise"] > out["round_robin"]
    assert out["kvgate_approx"] > out["round_robin"]
