"""``kvgate bench mooncake --choose``: the only place a cost-model weight may be chosen by looking at
results — the FIRST half of the Mooncake conversation trace. The benchmark reports on the second half
and on workloads never looked at here.

The physical coefficients (prefill and decode times, token budget, KV capacity) come from the engine's
timing profile (``TimingProfile.cost_params()``); this sweep covers the few weights that are not
physical, one at a time from the defaults, at the benchmark's two configurations.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from kvgate.bench.fleet import FleetSim
from kvgate.bench.report import bar, pct
from kvgate.bench.trace import TraceRequest, load_mooncake, speed_up, time_slice
from kvgate.router.cost import CostParams
from kvgate.sim.timing import TimingProfile, get_profile

VARIANTS: tuple[tuple[str, dict[str, float]], ...] = (
    ("defaults", {}),
    ("backlog_weight 0 (the model before the backlog charge)", {"backlog_weight": 0.0}),
    ("backlog_weight 0.5", {"backlog_weight": 0.5}),
    ("backlog_weight 2", {"backlog_weight": 2.0}),
    ("backlog_weight 4", {"backlog_weight": 4.0}),
    ("externality_weight 0", {"externality_weight": 0.0}),
    ("affinity_cache_fraction 0", {"affinity_cache_fraction": 0.0}),
    ("affinity_cache_fraction 2", {"affinity_cache_fraction": 2.0}),
    ("load_epsilon 0.5", {"load_epsilon": 0.5}),
    ("load_epsilon 2", {"load_epsilon": 2.0}),
)
CONFIGS = ((8, 1.0), (4, 3.0))


def first_half(trace_path: Path) -> list[TraceRequest]:
    return time_slice(load_mooncake(trace_path), 0.0, 0.5)


def evaluate(trace: Sequence[TraceRequest], profile: TimingProfile, n: int, cost: CostParams) -> tuple[float, ...]:
    res = FleetSim(n, profile, "kvgate_precise", cost=cost).run(trace)
    ttft = [(r.first_token - r.arrival) * 1000 for r in res if r.first_token is not None]
    return (sum(r.cached for r in res) / sum(r.prompt for r in res), sum(ttft) / len(ttft), pct(ttft, 0.99))


def run(trace_path: Path) -> str:
    profile = get_profile("dynamo-mocker")
    base = first_half(trace_path)
    lines = ["### Choosing the cost model's weights: Mooncake conversation trace, FIRST half only", "",
             "| variant | " + " | ".join(f"{n}w {s:g}×: reuse / mean / p99 (ms)" for n, s in CONFIGS) + " |",
             "|---|" + "---|" * len(CONFIGS)]
    with bar("choose", len(VARIANTS) * len(CONFIGS), "run") as b:
        for label, overrides in VARIANTS:
            cells = []
            for n, s in CONFIGS:
                cost = profile.cost_params(**overrides)
                reuse, mean, p99 = evaluate(speed_up(base, s), profile, n, cost)
                cells.append(f"{reuse:.4f} / {mean:.0f} / {p99:.0f}")
                b.update(1)
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
