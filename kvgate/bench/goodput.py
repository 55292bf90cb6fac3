"""Goodput: the highest arrival rate at which a policy keeps its p99 TTFT under the SLO.

The workload's arrivals are compressed by a speedup ``s`` (``s`` × its request rate); the search
doubles (or halves) ``s`` until the SLO flips, then bisects the last bracket geometrically. Every run
is a whole replay, so a policy's goodput is a property of the workload, not of one busy minute.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from kvgate.bench.fleet import FleetSim
from kvgate.bench.report import pct
from kvgate.bench.trace import TraceRequest, speed_up
from kvgate.sim.timing import TimingProfile

SLO_P99_MS = 2_000.0
"""p99 TTFT a deployment commits to: 2 s, a common interactive target (and about what a lone
40k-token prompt takes to prefill on this engine model)."""
WORKERS = 8

P99At = Callable[[float], float | None]
"""p99 TTFT (ms) of a whole replay at a speedup; None when the replay could not run."""


def search(p99_at: P99At, slo_ms: float = SLO_P99_MS, lo: float = 0.125, hi: float = 32.0,
           refine: int = 3) -> tuple[float, int]:
    """The highest speedup meeting the SLO (0 if even ``lo`` fails) and the replays it took."""
    runs = 0

    def ok(s: float) -> bool | None:
        nonlocal runs
        runs += 1
        v = p99_at(s)
        return None if v is None else v <= slo_ms

    s = 1.0
    first = ok(s)
    if first is None:
        return math.nan, runs
    good, bad = (s, None) if first else (None, s)
    while good is None or bad is None:
        nxt = (good * 2 if good is not None else bad / 2)  # type: ignore[operator]
        if nxt > hi or nxt < lo:
            return (good if good is not None else 0.0), runs
        res = ok(nxt)
        if res is None:
            return math.nan, runs
        good, bad = (nxt, bad) if res else (good, nxt)
    for _ in range(refine):
        mid = math.sqrt(good * bad)
        res = ok(mid)
        if res is None:
            break
        good, bad = (mid, bad) if res else (good, mid)
    return good, runs


def kvgate_p99(base: Sequence[TraceRequest], profile: TimingProfile, mode: str, n: int = WORKERS) -> P99At:
    def at(s: float) -> float:
        res = FleetSim(n, profile, mode).run(speed_up(base, s))
        return pct([(r.first_token - r.arrival) * 1000 for r in res if r.first_token is not None], 0.99)

    return at


def rate(base: Sequence[TraceRequest]) -> float:
    span = max(r.arrival_s for r in base) - min(r.arrival_s for r in base)
    return len(base) / span if span > 0 else math.nan


def goodput_search(name: str, base: Sequence[TraceRequest], profile: TimingProfile,
                   dynamo_p99: Callable[[Sequence[TraceRequest], int, str], P99At] | None,
                   tick: Callable[[str], None]) -> str:
    """A goodput table for ``base`` at 8 workers × 1M tokens."""
    def counted(label: str, f: P99At) -> P99At:
        def at(s: float) -> float | None:
            v = f(s)
            tick(f"goodput {label} ×{s:.2f}")
            return v

        return at

    policies: list[tuple[str, P99At]] = [("kvgate precise (events)", kvgate_p99(base, profile, "kvgate_precise"))]
    if dynamo_p99 is not None:
        policies.append(("Dynamo 1.6.1 kv_router", dynamo_p99(base, WORKERS, "kv_router")))
    r1 = rate(base)
    lines = [f"### {name} — goodput at {WORKERS} workers × 1M tokens (p99 TTFT ≤ {SLO_P99_MS / 1000:.0f} s)", "",
             "| policy | highest arrival speedup meeting the SLO | goodput (req/s) | replays |", "|---|---|---|---|"]
    for label, f in policies:
        s, runs = search(counted(label, f))
        shown = "–" if math.isnan(s) else (f"< {0.125}" if s == 0 else f"{s:.2f}×")
        lines.append(f"| {label} | {shown} | {'–' if math.isnan(s) else f'{s * r1:.2f}'} | {runs} |")
    return "\n".join(lines) + "\n"
