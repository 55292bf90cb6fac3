"""``kvgate bench tiering``: agent sessions with heavy-tailed tool waits on a simulated fleet whose GPU KV
overflows — no tiering / LMCache tiers without kvgate's lifecycle / kvgate full, each with and without
background prefill — with the floors of the tiering issue checked; then the rows a tiered fleet must
beat, on a shared pool's rates (``sim.tiers.MOONCAKE_POOL_GBPS``) in place of Redis: round robin + shared
pool, Dynamo's tier credits on kvgate's index, kvgate full, and the global-LRU references of the fleet's
GPU and GPU + CPU capacity.
"""

from __future__ import annotations

import copy
import json
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from kvgate.bench.agentfleet import AgentFleet, TierConfig, TurnResult
from kvgate.bench.agents import AgentParams, generate
from kvgate.bench.report import Floor, cdf_plot, floor_verdict
from kvgate.bench.trace import global_lru_reuse
from kvgate.bench.workloads import agentic_sessions, to_trace
from kvgate.session.prefill import ContinueStats
from kvgate.sim.tiers import MOONCAKE_POOL_GBPS, MOONCAKE_POOL_RTT_MS
from kvgate.sim.timing import TimingProfile, get_profile


def bench_profile(num_blocks: int = 7_500) -> TimingProfile:
    """Llama-3-8B on H100 timing with 64-token blocks (LMCache's 256-token chunk is 4 of them) and the
    GPU KV an 80 GB card has left after the weights: 7,500 blocks = 480k tokens."""
    return replace(get_profile("h100-llama3-8b"), name="h100-llama3-8b-b64", block_size=64, num_blocks=num_blocks)


@dataclass
class RowStats:
    name: str
    resumed_p50: float
    resumed_p99: float
    user_p50: float
    user_p99: float
    heavy_user_p50: float
    heavy_user_p99: float
    recomputed_mtok: float
    computed_mtok: float
    loaded_cpu_mtok: float
    loaded_remote_mtok: float
    gpu_resident_at_resume: float
    """Mean share of a resumed request's prompt still on its home worker's GPU when it arrived."""
    reserved_per_parked: float
    prefills_issued: int
    prefills_used: int
    prefills_wasted: int
    prefills_skipped: int
    bg_computed_mtok: float
    preemptions: int
    requests: int
    sim_s: float
    resumed_ttfts: list[float]
    reuse: float = 0.0
    """Prompt tokens not computed (GPU hit or tier load) over all prompt tokens."""
    mean_ms: float = 0.0
    """TTFT over every request (first, tool and user turns)."""
    p99_ms: float = 0.0


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * q))]


def stats(name: str, fleet: AgentFleet, res: list[TurnResult], sim_s: float) -> RowStats:
    done = [r for r in res if r.first_token is not None]
    resumed = [r.ttft_ms for r in done if r.kind == "tool"]
    user = [r.ttft_ms for r in done if r.kind == "user"]
    heavy = [r.ttft_ms for r in done if r.kind == "user" and r.heavy]
    tool = [r for r in done if r.kind == "tool"]
    ps = fleet.prefill_stats
    every = [r.ttft_ms for r in done]
    row = RowStats(
        name, _pct(resumed, 0.5), _pct(resumed, 0.99), _pct(user, 0.5), _pct(user, 0.99), _pct(heavy, 0.5),
        _pct(heavy, 0.99), sum(r.recomputed for r in done) / 1e6,
        sum(e.stats.computed_prefill_tokens for e in fleet.engines) / 1e6,
        sum(e.stats.loaded_cpu_tokens for e in fleet.engines) / 1e6,
        sum(e.stats.loaded_remote_tokens for e in fleet.engines) / 1e6,
        sum(r.gpu_resident / r.prompt for r in tool) / max(1, len(tool)),
        sum(fleet.reserved_samples) / max(1, len(fleet.reserved_samples)),
        ps.issued, ps.used, ps.wasted, ps.skipped, fleet.bg_computed / 1e6,
        sum(e.stats.preemptions for e in fleet.engines), len(done), sim_s, resumed)
    row.reuse = sum(max(0, r.reuse) for r in done) / max(1, sum(r.prompt for r in done))
    row.mean_ms = sum(every) / max(1, len(every))
    row.p99_ms = _pct(every, 0.99)
    return row


ROWS: tuple[tuple[str, str, bool], ...] = (
    ("no tiering", "no_tiering", False),
    ("LMCache tiers, no kvgate lifecycle", "lmcache", False),
    ("kvgate full", "kvgate", False),
    ("no tiering + background prefill", "no_tiering", True),
    ("kvgate full + background prefill", "kvgate", True),
)


POOL_ROWS: tuple[tuple[str, str, bool], ...] = (
    ("round robin + shared pool", "rr_pool", False),
    ("Dynamo tier credits on kvgate's index, L1 + shared pool", "dynamo_credits", False),
    ("kvgate full, L1 + shared pool", "kvgate", False),
)
"""The rows a tiered fleet must beat, all on one shared pool's rates in place of Redis (issue 23)."""


def pool_tiers(tiers: TierConfig | None) -> TierConfig:
    """The fleet's tiers with the remote one a shared pool (Mooncake store's rates, ``sim/tiers.py``)."""
    return replace(tiers or TierConfig(), remote_gbps=MOONCAKE_POOL_GBPS, remote_rtt_ms=MOONCAKE_POOL_RTT_MS)


def bounds(params: AgentParams, n_workers: int, per_node: int, tiers: TierConfig | None,
           profile: TimingProfile) -> list[tuple[str, float]]:
    """Reuse of one LRU cache of the fleet's GPU capacity, and of GPU + the nodes' CPU tiers, over the
    same sessions as an open-loop trace (``workloads.to_trace``: each call at its predecessor's arrival +
    a nominal service time + the scripted wait), the references of ``bench mooncake``."""
    tc = tiers or TierConfig()
    trace = to_trace(agentic_sessions(params))
    gpu = n_workers * profile.num_blocks * profile.block_size
    host = -(-n_workers // per_node) * tc.cpu_tokens_per_node
    return [(f"global LRU of GPU capacity ({gpu / 1e6:.1f}M tokens)", global_lru_reuse(trace, gpu)),
            (f"global LRU of GPU + CPU capacity ({(gpu + host) / 1e6:.1f}M tokens)",
             global_lru_reuse(trace, gpu + host))]


def warm_continuation(params: AgentParams, n_workers: int, per_node: int, tiers: TierConfig | None,
                      profile: TimingProfile | None = None) -> ContinueStats:
    """A deployment's continuation statistics in steady state: whether a user comes back is learned
    only ``settle_s`` (30 min) after an answer, longer than the measured run, so the prefill rows start
    from what a first run of the same workload (another seed) learned, and keep learning."""
    fleet = AgentFleet(profile or bench_profile(), n_workers, per_node, "kvgate", prefill=True, tiers=tiers)
    fleet.run(generate(replace(params, seed=params.seed + 1_000)))
    return fleet.continues


def run_rows(params: AgentParams, n_workers: int = 4, per_node: int = 2, tiers: TierConfig | None = None,
             rows: tuple[tuple[str, str, bool], ...] = ROWS, profile: TimingProfile | None = None,
             pool: bool = False) -> list[RowStats]:
    """``pool``: the fleet's remote tier is a shared pool (``pool_tiers``) for every row."""
    if pool:
        tiers = pool_tiers(tiers)
    profile = profile or bench_profile()
    scripts = generate(params)
    learned = warm_continuation(params, n_workers, per_node, tiers, profile) if any(p for *_, p in rows) else None
    out = []
    for label, mode, prefill in rows:
        t0 = time.perf_counter()
        fleet = AgentFleet(profile, n_workers, per_node, mode, prefill=prefill, tiers=tiers,
                           continues=copy.deepcopy(learned) if prefill else None)
        res = fleet.run(scripts)
        out.append(stats(label, fleet, res, time.perf_counter() - t0))
    return out


def table(rows: list[RowStats]) -> str:
    lines = [
        "| row | resumed TTFT p50 (ms) | p99 | user turn p50 | p99 | reasoning-heavy user turn p50 | p99 | "
        "recomputed (M tok) | computed (M tok) | loaded CPU / remote (M tok) | GPU share at resume | "
        "reserved tok / parked session | preemptions | prefills issued / used / wasted / skipped |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r.name} | {r.resumed_p50:.0f} | {r.resumed_p99:.0f} | {r.user_p50:.0f} | {r.user_p99:.0f} | "
            f"{r.heavy_user_p50:.0f} | {r.heavy_user_p99:.0f} | {r.recomputed_mtok:.2f} | {r.computed_mtok:.2f} | "
            f"{r.loaded_cpu_mtok:.2f} / {r.loaded_remote_mtok:.2f} | {r.gpu_resident_at_resume:.2f} | "
            f"{r.reserved_per_parked:.0f} | {r.preemptions} | {r.prefills_issued} / {r.prefills_used} / "
            f"{r.prefills_wasted} / "
            f"{r.prefills_skipped} |")
    return "\n".join(lines) + "\n"


def pool_table(rows: list[RowStats], refs: list[tuple[str, float]]) -> str:
    lines = ["| row | token reuse | reuse / GPU bound | TTFT mean, every request (ms) | p99 | resumed p50 | p99 | "
             "user turn p50 | p99 | recomputed (M tok) | loaded CPU / pool (M tok) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    gpu = refs[0][1] if refs else float("nan")
    for r in rows:
        lines.append(f"| {r.name} | {r.reuse:.4f} | {r.reuse / gpu:.3f} | {r.mean_ms:.0f} | {r.p99_ms:.0f} | "
                     f"{r.resumed_p50:.0f} | {r.resumed_p99:.0f} | {r.user_p50:.0f} | {r.user_p99:.0f} | "
                     f"{r.recomputed_mtok:.2f} | {r.loaded_cpu_mtok:.2f} / {r.loaded_remote_mtok:.2f} |")
    lines += [f"| {name} (reuse only) | {v:.4f} | {v / gpu:.3f} | – | – | – | – | – | – | – | – |" for name, v in refs]
    return "\n".join(lines) + "\n"


def pool_floors(rows: list[RowStats], refs: list[tuple[str, float]]) -> list[tuple[str, float, str, bool]]:
    """Issue 23's targets: kvgate ahead of round robin + shared pool on mean and p99 TTFT, and reusing more
    than one LRU cache of the fleet's GPU capacity could."""
    by = {r.name: r for r in rows}
    k, rr = by[POOL_ROWS[2][0]], by[POOL_ROWS[0][0]]
    out = [("mean TTFT, kvgate full / round robin + shared pool", k.mean_ms / rr.mean_ms, "< 1.0"),
           ("p99 TTFT, kvgate full / round robin + shared pool", k.p99_ms / rr.p99_ms, "< 1.0"),
           ("resumed p99 TTFT, kvgate full / round robin + shared pool", k.resumed_p99 / rr.resumed_p99, "< 1.0")]
    if refs:
        out.append(("reuse, kvgate full / global LRU of GPU capacity", k.reuse / refs[0][1], "> 1.0"))
    return [(n, v, t, v < 1.0 if t.startswith("<") else v > 1.0) for n, v, t in out]


def held_out(seeds: tuple[int, ...], quick: bool = False, loads: str = "sync") -> str:
    """The first floor (resumed p99, kvgate full / no tiering) on seeds other than the benchmark's;
    ``loads``: the engines' tier loads, ``sync`` or ``async`` (``sim.tiers.EngineTiers.async_loads``)."""
    lines = ["| seed | resumed p99 no tiering (ms) | kvgate full | ratio | target ≤ 0.5 |", "|---|---|---|---|---|"]
    base = AgentParams(sessions=80, start_window_s=200.0) if quick else AgentParams()
    profile = bench_profile(2_500 if quick else 7_500)
    tiers = tier_config(loads)
    for seed in seeds:
        rows = run_rows(replace(base, seed=seed), profile=profile, rows=ROWS[:1] + ROWS[2:3], tiers=tiers)
        v = rows[1].resumed_p99 / rows[0].resumed_p99
        lines.append(f"| {seed} | {rows[0].resumed_p99:.0f} | {rows[1].resumed_p99:.0f} | {v:.3f} | "
                     f"{'yes' if v <= 0.5 else 'NO'} |")
    return "\n".join(lines) + "\n"


def tier_config(loads: str) -> TierConfig:
    if loads not in ("sync", "async"):
        raise ValueError(f"loads must be sync or async, not {loads!r}")
    return TierConfig(async_loads=loads == "async")


def floors(rows: list[RowStats]) -> list[tuple[str, float, str, bool]]:
    by = {r.name: r for r in rows}
    base, full, pre = by["no tiering"], by["kvgate full"], by["kvgate full + background prefill"]
    settled = pre.prefills_used + pre.prefills_wasted
    waste = pre.prefills_wasted / settled if settled else 0.0
    out = [
        ("resumed p99 TTFT, kvgate full / no tiering", full.resumed_p99 / base.resumed_p99, "≤ 0.5"),
        ("tokens recomputed, kvgate full / no tiering", full.recomputed_mtok / max(1e-9, base.recomputed_mtok),
         "≤ 0.3"),
        ("reasoning-heavy next-user-turn p50 TTFT, with / without background prefill",
         pre.heavy_user_p50 / full.heavy_user_p50, "≤ 0.7"),
        ("background prefills wasted / settled", waste, "≤ 0.2"),
    ]
    return [(n, v, t, v <= float(t.split()[-1])) for n, v, t in out]


def run(out_dir: Path, quick: bool = False, real: bool = True, loads: str = "sync") -> int:
    """``loads``: how the simulated engines wait for tier loads (``tier_config``)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tiers = tier_config(loads)
    # --quick: a third of the sessions on a third of the GPU KV, so the fleet still overflows.
    params = AgentParams(sessions=80, start_window_s=200.0) if quick else AgentParams()
    profile = bench_profile(2_500 if quick else 7_500)
    t0 = time.perf_counter()
    rows = run_rows(params, profile=profile, tiers=tiers)
    text = [f"## Agent sessions with tool waits ({params.sessions} sessions, 4 workers on 2 nodes, "
            f"{profile.name}, GPU KV {profile.num_blocks * profile.block_size // 1000}k tokens per worker, "
            f"tier loads {loads})", "",
            table(rows), "### Floors", "",
            "| floor | measured | target | ok |", "|---|---|---|---|"]
    # --quick: a third of the sessions is too few to judge a p99 by; its floors are shown, not judged.
    fl = [(n, v, t, None if quick else ok) for n, v, t, ok in floors(rows)]
    text += [f"| {n} | {v:.3f} | {t} | {'–' if ok is None else 'yes' if ok else 'NO'} |" for n, v, t, ok in fl]
    t1 = time.perf_counter()
    pool_rows = run_rows(params, profile=profile, rows=POOL_ROWS, pool=True, tiers=tiers)
    refs = bounds(params, 4, 2, tiers, profile)
    text += ["", f"## The rows a tiered fleet must beat: the remote tier a shared pool ({MOONCAKE_POOL_GBPS:.0f} GB/s, "
             f"{MOONCAKE_POOL_RTT_MS} ms a load, unbounded; round robin's engines have no L1)", "",
             pool_table(pool_rows, refs), "| floor | measured | target | ok |", "|---|---|---|---|"]
    pfl = [(n, v, t, None if quick else ok) for n, v, t, ok in pool_floors(pool_rows, refs)]
    text += [f"| {n} | {v:.3f} | {t} | {'–' if ok is None else 'yes' if ok else 'NO'} |" for n, v, t, ok in pfl]
    text.append(f"\n(pool rows simulated in {time.perf_counter() - t1:.0f} s)")
    fl += pfl
    text.append(f"\nsimulated in {time.perf_counter() - t0:.0f} s; CDF plot: {out_dir / 'tiering-resumed.png'}")
    cdf_plot(out_dir / "tiering-resumed.png", [("", [(f"{r.name} (p99 {r.resumed_p99:.0f} ms)", r.resumed_ttfts)
                                                      for r in rows])], "TTFT of resumed turns (ms, log)")
    code = floor_verdict("tiering", [Floor("agent sessions", n, v, t, ok) for n, v, t, ok in fl])
    if quick:
        text.append("--quick is a smoke run: the floors are judged on the full run.")
    if real:
        from kvgate.bench.tiering_real import run_real

        real_text, real_ok = run_real()
        text += ["", real_text]
        if not real_ok:
            print("kvgate bench tiering: floor failed: real vLLM + LMCache + Redis (see its table)", file=sys.stderr)
            code = 1
    report = "\n".join(text)
    print(report)
    (out_dir / "tiering.md").write_text(report + "\n")
    (out_dir / "tiering.json").write_text(json.dumps([{k: v for k, v in asdict(r).items() if k != "resumed_ttfts"}
                                                      for r in rows + pool_rows], indent=1))
    return code


if __name__ == "__main__":  # python -m kvgate.bench.tiering --held-out 7,11,12,13 [--loads async]
    import argparse

    ap = argparse.ArgumentParser(description="kvgate bench tiering's first floor on chosen seeds")
    ap.add_argument("--held-out", required=True, help="comma-separated seeds")
    ap.add_argument("--loads", choices=("sync", "async"), default="sync")
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    print(held_out(tuple(int(x) for x in a.held_out.split(",")), a.quick, a.loads))
