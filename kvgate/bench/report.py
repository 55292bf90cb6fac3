"""Tables and plots for benchmark results: Markdown tables on stdout, PNG plots beside them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Row:
    name: str
    reuse: float
    prefill_mtok: float | None = None
    ttft_mean: float | None = None
    ttft_p50: float | None = None
    ttft_p99: float | None = None
    out_tok_s: float | None = None
    load_max_mean: float | None = None
    route_us: float | None = None
    ttfts_ms: Sequence[float] = ()


def _f(v: float | None, fmt: str) -> str:
    return "–" if v is None else format(v, fmt)


def table(title: str, rows: Sequence[Row]) -> str:
    head = ("| row | token reuse | prefill computed (M tok) | TTFT mean (ms) | p50 | p99 | throughput (out tok/s) "
            "| max/mean worker load | routing µs/req |")
    lines = [f"### {title}", "", head, "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.name} | {r.reuse:.4f} | {_f(r.prefill_mtok, '.1f')} | {_f(r.ttft_mean, '.1f')} | "
                     f"{_f(r.ttft_p50, '.1f')} | {_f(r.ttft_p99, '.1f')} | {_f(r.out_tok_s, '.0f')} | "
                     f"{_f(r.load_max_mean, '.3f')} | {_f(r.route_us, '.0f')} |")
    return "\n".join(lines) + "\n"


def plot(path: Path, panels: Sequence[tuple[str, Sequence[Row]]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.5), squeeze=False)
    for ax, (title, rows) in zip(axes[0], panels, strict=True):
        for r in rows:
            if not r.ttfts_ms:
                continue
            xs = sorted(r.ttfts_ms)
            ys = [(i + 1) / len(xs) for i in range(len(xs))]
            ax.plot(xs, ys, label=f"{r.name} (mean {r.ttft_mean:.0f} ms, reuse {r.reuse:.3f})", linewidth=1.4)
        ax.set_xscale("log")
        ax.set_xlabel("TTFT (ms, log)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
