"""The agent workload on a simulated fleet: every mode plays every request; tiers and prefill do what
they claim at small scale (the floors are the benchmark's job)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvgate.bench.agentfleet import AgentFleet, TierConfig
from kvgate.bench.agents import AgentParams, canonical_history, generate, next_turn_prefix
from kvgate.bench.tiering import bench_profile

SMALL = AgentParams(sessions=12, start_window_s=5.0, rounds_mean=3.0, user_turns_max=3, seed=3,
                    interactive_continue_p=1.0, oneshot_continue_p=1.0, max_context_tokens=8_000)


def fleet(mode: str, prefill: bool = False, blocks: int = 1000) -> AgentFleet:
    return AgentFleet(replace(bench_profile(), num_blocks=blocks), 2, 1, mode, prefill=prefill,
                      tiers=TierConfig(cpu_tokens_per_node=400_000))


def test_workload_is_deterministic_and_drops_reasoning_at_user_turns() -> None:
    a, b = generate(SMALL), generate(SMALL)
    assert [len(s.rounds) for s in a] == [len(s.rounds) for s in b]
    s = next(s for s in a if len({r.turn for r in s.rounds}) > 1)
    first_user = next(i for i, r in enumerate(s.rounds) if r.turn == 1)
    prev = canonical_history(s, first_user - 1)
    nxt = canonical_history(s, first_user)
    assert nxt[: len(s.system)] == s.system
    # The new user turn starts with the previous turn's canonical branch (reasoning gone).
    assert nxt[: len(next_turn_prefix(s, first_user - 1))] == next_turn_prefix(s, first_user - 1)
    assert prev[: len(s.system)] == s.system and len(nxt) < len(prev) + sum(len(r.reasoning) for r in s.rounds) + 10**6


@pytest.mark.parametrize("mode", ["no_tiering", "lmcache", "kvgate"])
def test_every_request_is_served(mode: str) -> None:
    scripts = generate(SMALL)
    res = fleet(mode).run(scripts)
    assert len(res) == sum(len(s.rounds) for s in scripts)
    assert all(r.first_token is not None and r.finish is not None for r in res)


def test_async_loads_serve_every_request_and_still_replace_recompute() -> None:
    scripts = generate(SMALL)
    f = AgentFleet(replace(bench_profile(), num_blocks=500), 2, 1, "kvgate",
                   tiers=TierConfig(cpu_tokens_per_node=400_000, async_loads=True))
    res = f.run(scripts)
    assert len(res) == sum(len(s.rounds) for s in scripts)
    assert all(r.first_token is not None and r.finish is not None for r in res)
    assert f.policy.params.tier_loads == "async" and all(e.channel.backlog_ms() == 0 for e in f.engines)
    assert sum(e.stats.external_tokens for e in f.engines) > 0


def test_tiers_replace_recompute_when_the_gpu_is_small() -> None:
    scripts = generate(SMALL)
    base = fleet("no_tiering", blocks=500)
    base_res = base.run(scripts)
    full = fleet("kvgate", blocks=500)
    full_res = full.run(scripts)
    assert sum(e.stats.external_tokens for e in base.engines) == 0
    assert sum(e.stats.external_tokens for e in full.engines) > 0
    assert sum(r.recomputed for r in full_res) < sum(r.recomputed for r in base_res)
    assert full.predictor.observed > 0  # tool waits were measured and fed back


def test_background_prefill_warms_the_next_user_turn() -> None:
    scripts = generate(SMALL)
    without = fleet("kvgate").run(scripts)
    f = fleet("kvgate", prefill=True)
    with_ = f.run(scripts)
    ps = f.prefill_stats
    assert ps.issued > 0 and ps.used > 0
    reuse_without = sum(r.reuse for r in without if r.kind == "user")
    reuse_with = sum(r.reuse for r in with_ if r.kind == "user")
    assert reuse_with > reuse_without
