"""Tables, percentiles, progress and plots for benchmark results: Markdown tables on stdout, progress
bars on stderr, PNG plots beside the tables.

Percentiles are Dynamo's (its replay's summary, checked against its own per-request output): the
sample at index ``round((N − 1)·q)`` of the sorted values, so a kvgate row and a Dynamo row of the
same table are summarised the same way.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn, TypeVar

from tqdm import tqdm

T = TypeVar("T")


def pct(xs: Sequence[float], q: float, *, presorted: bool = False) -> float:
    """Dynamo 1.6.1's percentile: the sorted sample nearest to rank (N − 1)·q (halves round up)."""
    if not xs:
        return math.nan
    s = xs if presorted else sorted(xs)
    return s[min(len(s) - 1, math.floor((len(s) - 1) * q + 0.5))]


@dataclass(frozen=True, slots=True)
class Spread:
    """A figure's range over the slices of a run (time windows of a trace, or generator seeds)."""

    low: float
    high: float


@dataclass
class Row:
    name: str
    reuse: float
    prefill_mtok: float | None = None
    ttft_mean: float | None = None
    ttft_p50: float | None = None
    ttft_p99: float | None = None
    out_tok_s: float | None = None
    """Kept for callers that fill it positionally; not printed (equal for every policy at a fixed rate)."""
    load_max_mean: float | None = None
    route_us: float | None = None
    ttfts_ms: Sequence[float] = ()
    bound: float | None = None
    """The table's global-LRU reuse bound, for the ``reuse / bound`` column."""
    reuse_only: bool = False
    """A reference (a bound, unbounded capacity): only its reuse means something."""
    mean_spread: Spread | None = None
    p99_spread: Spread | None = None
    extra: dict[str, float] = field(default_factory=dict)


def _f(v: float | None, fmt: str) -> str:
    return "–" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, fmt)


def _with_spread(v: float | None, s: Spread | None) -> str:
    if v is None:
        return "–"
    return f"{v:.0f}" if s is None else f"{v:.0f} ({s.low:.0f}–{s.high:.0f})"


def table(title: str, rows: Sequence[Row], note: str = "") -> str:
    head = ("| row | token reuse | reuse / bound | prefill computed (M tok) | TTFT mean (ms) | p50 | p99 "
            "| max/mean worker load | routing µs/req |")
    lines = [f"### {title}", ""] + ([note, ""] if note else []) + [head, "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = r.reuse / r.bound if r.bound else None
        name = f"{r.name} (reuse only)" if r.reuse_only else r.name
        if r.reuse_only:
            lines.append(f"| {name} | {r.reuse:.4f} | {_f(ratio, '.3f')} | – | – | – | – | – | – |")
            continue
        lines.append(f"| {name} | {r.reuse:.4f} | {_f(ratio, '.3f')} | {_f(r.prefill_mtok, '.1f')} | "
                     f"{_with_spread(r.ttft_mean, r.mean_spread)} | {_f(r.ttft_p50, '.0f')} | "
                     f"{_with_spread(r.ttft_p99, r.p99_spread)} | {_f(r.load_max_mean, '.3f')} | "
                     f"{_f(r.route_us, '.0f')} |")
    return "\n".join(lines) + "\n"


def progress(items: Iterable[T], desc: str, total: int | None = None) -> Iterator[T]:
    """A progress bar with ETA on stderr (stdout keeps only the tables); silent when stderr is not a
    terminal and ``KVGATE_PROGRESS`` is unset, so logs of a CI run stay readable."""
    yield from tqdm(items, desc=desc, total=total, file=sys.stderr, dynamic_ncols=True, leave=False,
                    mininterval=1.0, disable=False if _forced() else None)


def bar(desc: str, total: float, unit: str = "it") -> tqdm[NoReturn]:
    """A manually advanced progress bar (``.update(n)``), for loops that are not iterables."""
    return tqdm(desc=desc, total=total, unit=unit, file=sys.stderr, dynamic_ncols=True, leave=False,
                mininterval=1.0, disable=False if _forced() else None)


def _forced() -> bool:
    import os

    return bool(os.environ.get("KVGATE_PROGRESS"))


Series = tuple[str, Sequence[float]]
"""One curve: its label and its samples."""


def cdf_plot(path: Path, panels: Sequence[tuple[str, Sequence[Series]]], xlabel: str = "TTFT (ms, log)") -> None:
    """Empirical CDFs, one panel per table, log x axis; series without samples are skipped."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # One colour per series name (the label before its figures) across panels, so a policy keeps its colour.
    names = list(dict.fromkeys(label.split(" (")[0] for _, series in panels for label, _ in series))
    cmap = plt.get_cmap("tab10")
    colour = {n: cmap(i % 10) for i, n in enumerate(names)}
    cols = min(3, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.5 * cols, 4.5 * rows), squeeze=False)
    for ax, (title, series) in zip(axes.flat, panels, strict=False):
        for label, values in series:
            if not values:
                continue
            xs = sorted(values)
            ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=label, linewidth=1.3,
                    color=colour[label.split(" (")[0]])
        ax.set_xscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("fraction of requests")
        ax.set_title(title, fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def row_series(rows: Iterable[Row]) -> list[Series]:
    """A table's rows as CDF series labelled with their mean TTFT and reuse."""
    return [(f"{r.name} (mean {r.ttft_mean:.0f} ms, reuse {r.reuse:.3f})", r.ttfts_ms)
            for r in rows if r.ttfts_ms and r.ttft_mean is not None]


@dataclass(frozen=True, slots=True)
class Floor:
    """One target a benchmark checks: ``ok`` None when this run has nothing to judge it by."""

    table: str
    label: str
    value: float | None
    target: str
    ok: bool | None


def floor_verdict(bench: str, floors: Iterable[Floor]) -> int:
    """The exit code of a benchmark that printed ``floors``: 1 if any failed, each named on stderr with
    its measured value and target (a table's "NO" in a long report is easy to miss; a CI run's exit code
    is not)."""
    failed = [f for f in floors if f.ok is False]
    for f in failed:
        v = "–" if f.value is None else f"{f.value:.3f}"
        print(f"kvgate bench {bench}: floor failed: {f.table}: {f.label} measured {v}, target {f.target}",
              file=sys.stderr)
    return 1 if failed else 0
