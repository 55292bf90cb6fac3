"""``kvgate tune LOG``: the log replayed with the gateway's current settings and with each candidate, one
table row each, the best by the objective and the ``PATCH /admin/policy`` body that applies it; first
the fidelity of the current row against what the gateway recorded for the same requests."""

from __future__ import annotations

import itertools
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kvgate.tune.log import read_logs, sessions
from kvgate.tune.replay import SECTIONS, SETTINGS, Fleet, Outcome, Overrides, parse_overrides, recorded

OBJECTIVES: dict[str, tuple[str, Callable[[Outcome], float]]] = {
    "ttft_mean": ("mean TTFT", lambda o: o.ttft_mean_ms),
    "ttft_p50": ("TTFT p50", lambda o: o.ttft_p50_ms),
    "ttft_p99": ("TTFT p99", lambda o: o.ttft_p99_ms),
    "reuse": ("token reuse", lambda o: -o.reuse),
    "recomputed": ("recomputed tokens", lambda o: float(o.recomputed_tokens)),
}
"""What "best" means; every one is lower-is-better (reuse negated)."""
MIN_GAIN = 0.01
"""A candidate must beat the current settings by this fraction of the objective to be proposed."""


def default_grid(prefill: bool) -> dict[str, list[float]]:
    grid = {"waits.reserve_max_s": [1.0, 2.0, 5.0, 10.0], "cost.affinity_cache_fraction": [1.0, 4.0, 8.0]}
    if prefill:
        grid["prefill.min_continue"] = [0.5, 0.8, 0.95]
    return grid


def grid_candidates(grid: dict[str, list[float]]) -> list[str]:
    keys = list(grid)
    return [",".join(f"{k}={v:g}" for k, v in zip(keys, combo, strict=True))
            for combo in itertools.product(*(grid[k] for k in keys))]


def parse_grid(items: Sequence[str]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for item in items:
        key, sep, values = item.partition("=")
        if not sep:
            raise ValueError(f"--grid {item!r}: expected SECTION.FIELD=V1,V2,...")
        out[key.strip()] = [float(v) for v in values.split(",") if v.strip()]
    return out


def patch_body(over: Overrides) -> dict[str, Any]:
    return {k: v for k, v in over.items() if k in SECTIONS}


def _delta(a: float, b: float) -> str:
    return f"{(a - b) / b * 100:+.1f}%" if b else "n/a"


@dataclass(frozen=True, slots=True)
class Row:
    name: str
    over: Overrides
    out: Outcome


def _table(rows: Sequence[Row]) -> list[str]:
    w = max(24, *(len(r.name) for r in rows))
    head = (f"{'candidate':<{w}}  {'reuse':>6}  {'TTFT p50':>9}  {'TTFT p99':>9}  {'TTFT mean':>9}  "
            f"{'recomputed':>10}  {'prefill waste':>13}  {'KV parked':>9}")
    lines = [head, "-" * len(head)]
    for r in rows:
        o = r.out
        lines.append(f"{r.name:<{w}}  {o.reuse:>6.1%}  {o.ttft_p50_ms:>6.1f} ms  {o.ttft_p99_ms:>6.1f} ms  "
                     f"{o.ttft_mean_ms:>6.1f} ms  {o.recomputed_tokens:>10,}  {o.prefill_waste_tokens:>13,}  "
                     f"{o.kv_parked_tokens:>9,.0f}")
    return lines


def fidelity(rep: Outcome, rec: Outcome) -> list[str]:
    return [
        "fidelity (current settings replayed against what the gateway recorded, same requests):",
        f"  cached tokens  replay {rep.cached_tokens:,}  recorded {rec.cached_tokens:,}  "
        f"({_delta(rep.cached_tokens, rec.cached_tokens)})",
        f"  TTFT p50       replay {rep.ttft_p50_ms:.1f} ms  recorded {rec.ttft_p50_ms:.1f} ms  "
        f"({_delta(rep.ttft_p50_ms, rec.ttft_p50_ms)})",
        f"  TTFT p99       replay {rep.ttft_p99_ms:.1f} ms  recorded {rec.ttft_p99_ms:.1f} ms  "
        f"({_delta(rep.ttft_p99_ms, rec.ttft_p99_ms)})",
        f"  TTFT mean      replay {rep.ttft_mean_ms:.1f} ms  recorded {rec.ttft_mean_ms:.1f} ms  "
        f"({_delta(rep.ttft_mean_ms, rec.ttft_mean_ms)})",
        *_gap(rep, rec)]


def _gap(rep: Outcome, rec: Outcome) -> list[str]:
    gaps = sorted(rec.ttft_ms[k] - v for k, v in rep.ttft_ms.items() if k in rec.ttft_ms)
    if not gaps:
        return []
    return [f"  per request, recorded minus replayed TTFT: median {gaps[len(gaps) // 2]:+.1f} ms, p10 "
            f"{gaps[len(gaps) // 10]:+.1f} ms, p90 {gaps[9 * len(gaps) // 10]:+.1f} ms (the replay models the engines; "
            "the gateway's and the workers' own processing and the network are not in it)"]


def tune(paths: Sequence[Path], *, profile: str = "h100-llama3-8b", speed: float = 1.0, hidden_tokens: int = 0,
         model: str | None = None,
         candidates: Sequence[str] = (), grid: dict[str, list[float]] | None = None, sweep: bool = False,
         objective: str = "ttft_mean", progress: bool = True) -> tuple[str, list[Row]]:
    """The report, and its rows (current first)."""
    label, key = OBJECTIVES[objective]
    data = read_logs(paths)
    model, sess = sessions(data, model)
    bs = max((t.e.block_size for s in sess for t in s.turns), default=16)
    fleet = replace(Fleet.from_header(data.header, model, bs, profile, speed), hidden_tokens=hidden_tokens)
    names = list(candidates)
    if sweep or grid:
        names += grid_candidates(grid or default_grid(bool((data.header.get("prefill") or {}).get("enabled"))))
    overs = [parse_overrides(n) for n in names]
    for o in overs:
        fleet.settings(o)  # a bad value fails before any replay
    rows = []
    for i, (name, over) in enumerate([("current", {}), *zip(names, overs, strict=True)]):
        if progress:
            print(f"\rreplaying {i + 1}/{len(names) + 1}: {name}", end="", file=sys.stderr, flush=True)
        rows.append(Row(name, over, fleet.run(sess, over)))
    if progress:
        print(file=sys.stderr)
    n_req = sum(s.rounds() for s in sess)
    p = fleet.profile
    out = [f"kvgate tune: {n_req} requests of {len(sess)} conversations (model {model}, {bs}-token blocks) on "
           f"{fleet.workers} simulated workers ({p.name} timing{f' x{speed:g}' if speed != 1 else ''}, "
           f"{p.num_blocks} blocks each), in virtual time"]
    if data.skipped:
        out.append("not replayed: " + ", ".join(f"{k} {v}" for k, v in sorted(data.skipped.items())))
    out += ["", *fidelity(rows[0].out, recorded(sess)), "", *_table(rows), ""]
    best = min(rows[1:], key=lambda r: key(r.out), default=None)
    cur = key(rows[0].out)
    if best is None:
        out.append("no candidate given (--candidate, --sweep, --grid)")
    elif key(best.out) < cur - abs(cur) * MIN_GAIN:
        out.append(f"best by {label}: {best.name} ({_delta(key(best.out), cur)} against current)")
        body = patch_body(best.over)
        if body:
            out.append(f"apply: curl -X PATCH $KVGATE/admin/policy -H 'content-type: application/json' "
                       f"-d '{json.dumps(body)}'")
        restart = {k: v for k, v in best.over.items() if k in SETTINGS}
        for k, v in restart.items():
            out.append(f"and at the next restart: KVGATE_{k.upper()}={v:g}")
    else:
        out.append(f"keep the current settings: no candidate beats them by {MIN_GAIN:.0%} on {label}")
    return "\n".join(out), rows
