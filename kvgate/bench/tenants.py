"""``kvgate bench tenants``: what a heavy tenant sending ten times a light one's rate does to the light one's
time to first token, with admission off, on without the fair-share rule, and on as shipped.

Two parts, printed as tables side by side with their solo baselines:

1. **Virtual time** (``tenantfleet.py``): kvgate's admission and router code in front of simulated engines,
   over five workloads and ten seeds each (pooled: ~800 light requests per row). The design was settled
   while looking at seeds 1–5 of these workloads; the tables report seeds 6–15, which it was not
   looked at on. The workloads: the real-process part's (3 workers × 4 slots, 300-token prompts, 24
   output tokens, light 2 req/s); the same with 16 slots per worker; prompts of 100–2,000 tokens and
   answers of 16–256 (light 0.5 req/s); the light tenant as an agent (8-turn conversations whose history is cached where
   they were served); a wider fleet (8 workers × 16 slots, light 4 req/s).
2. **Real processes** (``tenants_real.py``): the first workload through ``kvgate serve`` and ``kvgate sim``
   processes over HTTP.

A third table shows what the cost model's slot wait does for agents when no admission holds requests
back (``slot_wait_weight`` 1 against 0).
"""

from __future__ import annotations

import multiprocessing
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from kvgate.bench import tenants_real
from kvgate.bench.report import cdf_plot, pct, progress
from kvgate.bench.tenantfleet import HEAVY, LIGHT, Mode, Workload, run

WORKLOADS = (
    Workload("3 workers x 4 slots, 300-token prompts"),
    Workload("3 workers x 16 slots", slots=16),
    # Long answers hold a slot ~4 s: at 2 req/s the light tenant alone would outrun its own max_concurrent.
    Workload("3 x 16, prompts 100-2000, outputs 16-256, light 0.5 req/s", slots=16, prompt=(100, 2000),
             output=(16, 256), light_rps=0.5),
    Workload("3 x 16, light is an agent (8 turns)", slots=16, prompt=(200, 400), light_turns=8),
    Workload("8 workers x 16 slots, light 4 req/s", workers=8, slots=16, light_rps=4.0),
)
SOLO = Mode("solo", heavy=False)
MODES = (
    Mode("admission off", admission=False),
    Mode("admission on, fair share off", fair_share=False),
    Mode("admission on"),
    Mode("admission on, caps learned", learned=True),
    Mode("admission on, light weight 3", light_weight=3.0),
)
REPORT_SEEDS = tuple(range(6, 16))
"""Seeds 1–5 are the ones the design was chosen on."""


@dataclass(frozen=True)
class Cell:
    light_ttft: list[float]
    light_status: dict[int, int]
    heavy_status: dict[int, int]
    heavy_tokens: int
    seconds: float


def _one(args: tuple[Workload, Mode, int]) -> Cell:
    w, mode, seed = args
    o = run(w, mode, seed)
    return Cell(o.ttft_ms(LIGHT), o.statuses(LIGHT), o.statuses(HEAVY), o.completed_tokens(HEAVY), w.seconds)


def measure(workloads: Sequence[Workload], modes: Sequence[Mode], seeds: Sequence[int], processes: int = 2
            ) -> dict[tuple[str, str, int], Cell]:
    jobs = [(w, m, s) for w in workloads for m in (SOLO, *modes) for s in seeds]
    with multiprocessing.get_context("spawn").Pool(processes) as pool:
        cells = list(progress(pool.imap(_one, jobs), "tenants (virtual time)", total=len(jobs)))
    return {(w.name, m.name, s): c for (w, m, s), c in zip(jobs, cells, strict=True)}


def _sum(ds: Sequence[dict[int, int]]) -> dict[int, int]:
    out: dict[int, int] = {}
    for d in ds:
        for k, v in d.items():
            out[k] = out.get(k, 0) + v
    return out


def table(cells: dict[tuple[str, str, int], Cell], workloads: Sequence[Workload], modes: Sequence[Mode],
          seeds: Sequence[int]) -> str:
    lines = [f"Virtual time, seeds {seeds[0]}-{seeds[-1]} pooled; light 2 req/s unless the workload says so, heavy "
             "10x its rate; max_concurrent 8 per tenant with admission on.", "",
             "| workload | mode | light n | light TTFT p50 (ms) | p99 (ms) | p50 / solo | p99 / solo | "
             "per-seed p99 / solo: median (range) | heavy 200 | heavy 429 | heavy 503 | heavy output tok/s | "
             "light non-200 |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for w in workloads:
        solo = [x for s in seeds for x in cells[(w.name, SOLO.name, s)].light_ttft]
        s50, s99 = pct(solo, .5), pct(solo, .99)
        for m in (SOLO, *modes):
            cs = [cells[(w.name, m.name, s)] for s in seeds]
            t = [x for c in cs for x in c.light_ttft]
            ratios = [pct(c.light_ttft, .99) / pct(cells[(w.name, SOLO.name, s)].light_ttft, .99)
                      for s, c in zip(seeds, cs, strict=True)]
            h = _sum([c.heavy_status for c in cs])
            other = _sum([{k: v for k, v in c.light_status.items() if k != 200} for c in cs])
            heavy = [str(h.get(k, 0)) for k in (200, 429, 503)] if m.heavy else ["-"] * 3
            tok = f"{sum(c.heavy_tokens for c in cs) / sum(c.seconds for c in cs):.0f}" if m.heavy else "-"
            lines.append("| " + " | ".join([
                w.name, m.name, str(len(t)), f"{pct(t, .5):.0f}", f"{pct(t, .99):.0f}", f"{pct(t, .5) / s50:.2f}",
                f"{pct(t, .99) / s99:.2f}",
                f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})", *heavy, tok,
                " ".join(f"{k}x{v}" for k, v in sorted(other.items())) or "0"]) + " |")
    return "\n".join(lines)


SLOT_WAIT_RATES = (3.0, 4.0)
AGENTS = Workload("agents on 3 workers x 4 slots", light_rps=3.0, prompt=(200, 400), output=(16, 96), light_turns=8)


def slot_wait_table(seeds: Sequence[int], processes: int = 2) -> str:
    """Agents alone, admission off (engines queue what they cannot run): the cost model with and without
    the wait for a running slot."""
    rows = ["Agents alone (8-turn conversations, 200-400 new tokens a turn, 16-96 output), admission off; "
            f"seeds {seeds[0]}-{seeds[-1]} pooled.", "",
            "| req/s | slot wait | n | TTFT mean (ms) | p50 | p90 | p99 |", "|---|---|---|---|---|---|---|"]
    jobs = [(replace(AGENTS, light_rps=r), Mode(f"slot wait {sw}", heavy=False, admission=False, slot_wait=sw), s)
            for r in SLOT_WAIT_RATES for sw in (False, True) for s in seeds]
    with multiprocessing.get_context("spawn").Pool(processes) as pool:
        cells = list(progress(pool.imap(_one, jobs), "slot wait (virtual time)", total=len(jobs)))
    for r in SLOT_WAIT_RATES:
        for sw in (False, True):
            t = [x for (w, m, _), c in zip(jobs, cells, strict=True)
                 if w.light_rps == r and m.slot_wait == sw for x in c.light_ttft]
            rows.append(f"| {r:g} | {'on' if sw else 'off'} | {len(t)} | {statistics.mean(t):.0f} | "
                        f"{pct(t, .5):.0f} | {pct(t, .9):.0f} | {pct(t, .99):.0f} |")
    return "\n".join(rows)


def plot(cells: dict[tuple[str, str, int], Cell], workloads: Sequence[Workload], modes: Sequence[Mode],
         seeds: Sequence[int], path: Path) -> None:
    panels = []
    for w in workloads:
        series = [(m.name, [x for s in seeds for x in cells[(w.name, m.name, s)].light_ttft])
                  for m in (SOLO, *modes) if m.admission or m.name == SOLO.name]
        panels.append((f"light tenant: {w.name}", series))
    cdf_plot(path, panels, xlabel="light tenant TTFT (ms, log)")


def run_bench(quick: bool = False, out: Path = Path("bench-out")) -> str:
    t0 = time.monotonic()
    workloads = WORKLOADS[:2] if quick else WORKLOADS
    seeds = REPORT_SEEDS[:2] if quick else REPORT_SEEDS
    cells = measure(workloads, MODES, seeds)
    parts = [table(cells, workloads, MODES, seeds)]
    out.mkdir(parents=True, exist_ok=True)
    plot(cells, workloads, MODES, seeds, out / "tenants-cdf.png")
    parts.append(f"CDF plot: {out / 'tenants-cdf.png'}")
    parts.append(slot_wait_table(seeds[:2] if quick else seeds[:5]))
    print(f"virtual time: {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
    p = tenants_real.Params(seconds=5.0) if quick else tenants_real.Params()
    parts.append(tenants_real.run(p, [REPORT_SEEDS[0]] if quick else list(REPORT_SEEDS[:2]), run_dir=out / "tenants"))
    text = "\n\n".join(parts)
    print(text)
    return text
