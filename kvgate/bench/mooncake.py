"""``kvgate bench mooncake``: the Mooncake conversation trace on simulated fleets, kvgate's policies
beside Dynamo's KV router (its own replay, run here), with the floors of the routing issue checked.

All kvgate rows run production routing code (``router/``) over ``sim.engine`` in virtual time with the
``dynamo-mocker`` timing profile — Dynamo's engine model — so the two columns differ only in routing.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict
from pathlib import Path

from kvgate.bench.dynamo import DynamoRun, run_dynamo
from kvgate.bench.fleet import FleetSim, Result
from kvgate.bench.report import Row, plot, table
from kvgate.bench.trace import TraceRequest, load_mooncake
from kvgate.sim.timing import get_profile

DEFAULT_TRACE = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "mooncake" / "conversation_trace.jsonl"
LABELS = {"round_robin": "round_robin", "least_loaded": "least_loaded", "session_affinity": "session_affinity",
          "kvgate_precise": "kvgate precise (events)", "kvgate_approx": "kvgate approximate (no events)"}


def _pct(xs: list[float], q: float) -> float:
    return xs[min(len(xs) - 1, int(len(xs) * q))]


def row_of(name: str, sim: FleetSim, res: list[Result]) -> Row:
    ttft = sorted((r.first_token - r.arrival) * 1000 for r in res if r.first_token is not None)
    prompt = sum(r.prompt for r in res)
    cached = sum(max(0, r.cached) for r in res)
    per_worker = [0] * len(sim.engines)
    for r in res:
        per_worker[r.worker] += r.prompt
    end = max(r.finish or 0 for r in res) - min(r.arrival for r in res)
    return Row(name, cached / prompt, sum(e.stats.computed_prefill_tokens for e in sim.engines) / 1e6,
               statistics.mean(ttft), _pct(ttft, 0.5), _pct(ttft, 0.99),
               sum(r.output for r in res) / end, max(per_worker) / (sum(per_worker) / len(per_worker)),
               sim.route_wall_s / len(res) * 1e6, ttft)


def dynamo_row(d: DynamoRun) -> Row:
    return Row(f"Dynamo 1.6.1 {d.mode}", d.reuse, None, d.ttft_mean_ms, d.ttft_p50_ms, d.ttft_p99_ms,
               d.output_tok_s)


def oracle_reuse(trace: list[TraceRequest]) -> float:
    """One cache of unbounded size (512-token trace blocks): the most reuse any routing could get."""
    nodes: dict[tuple[int, int], int] = {}  # (parent node, hash id) -> node: a prefix trie
    reused = total = 0
    for r in sorted(trace, key=lambda x: x.arrival_s):
        parent, n, hit = -1, 0, True
        for h in r.hash_ids:
            node = nodes.get((parent, h))
            if node is None:
                hit = False
                node = nodes[(parent, h)] = len(nodes)
            elif hit:
                n += 1
            parent = node
        reused += min(n * 512, r.input_length)
        total += r.input_length
    return reused / total


def run(trace_path: Path = DEFAULT_TRACE, out_dir: Path = Path("bench-out"), quick: bool = False,
        dynamo: bool = True, peers: bool = True) -> dict[str, object]:
    out_dir.mkdir(parents=True, exist_ok=True)
    profile = get_profile("dynamo-mocker")
    limit = 3000 if quick else None
    results: dict[str, object] = {}
    panels = []
    text = ["# kvgate bench mooncake", "",
            f"Trace: {trace_path.name}{' (first 3000 requests)' if quick else ''}; engine model: Dynamo "
            f"mocker (block {profile.block_size}, {profile.num_blocks} blocks = "
            f"{profile.num_blocks * profile.block_size:,} tokens per worker, 8192-token chunks).", ""]
    configs = [("8 workers × 1M tokens, 1× arrivals", 8, 1.0, None),
               ("4 workers × 1M tokens, 3× arrivals", 4, 3.0, None),
               ("8 workers, unbounded KV", 8, 1.0, 1 << 24)]
    for title, n, speed, blocks in configs:
        trace = load_mooncake(trace_path, limit, speed)
        rows: list[Row] = []
        modes = (["kvgate_precise", "session_affinity", "round_robin"] if blocks
                 else ["round_robin", "least_loaded", "session_affinity", "kvgate_precise", "kvgate_approx"])
        for mode in modes:
            prof = profile.with_overrides(num_blocks=blocks) if blocks else profile
            t0 = time.perf_counter()
            sim = FleetSim(n, prof, mode)
            res = sim.run(trace)
            row = row_of(LABELS[mode], sim, res)
            rows.append(row)
            print(f"  {title}: {mode} done in {time.perf_counter() - t0:.1f}s", flush=True)
        if dynamo and not blocks:
            for mode in ("kv_router", "round_robin"):
                try:
                    d = run_dynamo(trace_path, n, mode, speed)
                    rows.append(dynamo_row(d))
                    print(f"  {title}: Dynamo {mode} done in {d.wall_s:.1f}s", flush=True)
                except Exception as exc:  # report, keep the rest of the benchmark
                    print(f"  {title}: Dynamo {mode} failed: {exc}", flush=True)
        if blocks:
            rows.append(Row("oracle: one unbounded cache", oracle_reuse(trace)))
        text.append(table(title, rows))
        panels.append((title, rows))
        results[title] = [{k: v for k, v in asdict(r).items() if k != "ttfts_ms"} for r in rows]
    if peers:
        from kvgate.bench import peers as peer_bench

        n_req = 120 if quick else 300
        title = (f"Real processes: first {n_req} requests at 2× speed, 4 simulated workers in real time, "
                 "prompts at 1/4 length, ≤64 output tokens")
        try:
            prow = peer_bench.run(trace_path, n_requests=n_req, compress=2.0, n_workers=4, scale=0.25,
                                  max_output=64, run_dir=out_dir / "peers")
            text.append(table(title, prow))
            panels.append((title, prow))
            results[title] = [{k: v for k, v in asdict(r).items() if k != "ttfts_ms"} for r in prow]
        except Exception as exc:  # report, keep the rest
            text.append(f"### {title}\n\nfailed: {exc}\n")
    text.append(floors(results))
    from kvgate.bench.routing import report as routing_report

    text.append(routing_report())
    png = out_dir / "mooncake_ttft_cdf.png"
    plot(png, panels)
    text.append(f"Plot: {png}")
    report = "\n".join(text)
    (out_dir / "mooncake.md").write_text(report)
    (out_dir / "mooncake.json").write_text(json.dumps(results, indent=1))
    print(report)
    return results


def floors(results: dict[str, object]) -> str:
    def get(title: str, name: str) -> dict[str, float] | None:
        for r in results.get(title, []):  # type: ignore[attr-defined]
            if r["name"] == name:
                return r  # type: ignore[no-any-return]
        return None

    t8, t4, tu = list(results)[:3]
    lines = ["### Floors (ratios against the rows measured in this run)", "",
             "| floor | measured | target | ok |", "|---|---|---|---|"]

    def add(label: str, value: float | None, target: str, ok: bool | None) -> None:
        v = "–" if value is None else f"{value:.3f}"
        lines.append(f"| {label} | {v} | {target} | {'yes' if ok else ('–' if ok is None else 'NO')} |")

    k8, d8 = get(t8, LABELS["kvgate_precise"]), get(t8, "Dynamo 1.6.1 kv_router")
    if k8 and d8:
        add("8×1M reuse, kvgate precise / Dynamo kv_router", k8["reuse"] / d8["reuse"], "≥ 1.2",
            k8["reuse"] / d8["reuse"] >= 1.2)
        add("8×1M mean TTFT, kvgate / Dynamo", k8["ttft_mean"] / d8["ttft_mean"], "≤ 0.8",
            k8["ttft_mean"] / d8["ttft_mean"] <= 0.8)
        add("8×1M p99 TTFT, kvgate / Dynamo", k8["ttft_p99"] / d8["ttft_p99"], "≤ 1.0",
            k8["ttft_p99"] / d8["ttft_p99"] <= 1.0)
    rr, drr = get(t8, "round_robin"), get(t8, "Dynamo 1.6.1 round_robin")
    if rr and drr:
        add("simulator check: kvgate round_robin / Dynamo round_robin, mean TTFT", rr["ttft_mean"] / drr["ttft_mean"],
            "0.9–1.1", 0.9 <= rr["ttft_mean"] / drr["ttft_mean"] <= 1.1)
        ratio = rr["reuse"] / drr["reuse"]
        add("simulator check: reuse ratio", ratio, "0.9–1.1", 0.9 <= ratio <= 1.1)
        add("simulator check: p99 ratio", rr["ttft_p99"] / drr["ttft_p99"], "0.9–1.1",
            0.9 <= rr["ttft_p99"] / drr["ttft_p99"] <= 1.1)
    k4, d4 = get(t4, LABELS["kvgate_precise"]), get(t4, "Dynamo 1.6.1 kv_router")
    if k4 and d4:
        add("4 workers 3× arrivals mean TTFT, kvgate / Dynamo", k4["ttft_mean"] / d4["ttft_mean"], "≤ 0.8",
            k4["ttft_mean"] / d4["ttft_mean"] <= 0.8)
    ku, orc = get(tu, LABELS["kvgate_precise"]), get(tu, "oracle: one unbounded cache")
    if ku and orc:
        add("unbounded: reuse / oracle", ku["reuse"] / orc["reuse"], "≥ 0.95", ku["reuse"] / orc["reuse"] >= 0.95)
        add("unbounded: max/mean worker load", ku["load_max_mean"], "≤ 1.3", ku["load_max_mean"] <= 1.3)
    peer_title = next((t for t in results if t.startswith("Real processes")), None)
    if peer_title:
        rows: list[dict[str, float]] = results[peer_title]  # type: ignore[assignment]
        k = next((r for r in rows if str(r["name"]).startswith("kvgate")), None)
        others = [r for r in rows if r is not k and r.get("ttft_mean") is not None]
        if k and k.get("ttft_mean") is not None and others:
            best_mean = min(r["ttft_mean"] for r in others)
            best_p99 = min(r["ttft_p99"] for r in others)
            add("real processes: kvgate mean TTFT / best peer", k["ttft_mean"] / best_mean, "< 1",
                k["ttft_mean"] < best_mean)
            add("real processes: kvgate p99 TTFT / best peer", k["ttft_p99"] / best_p99, "< 1",
                k["ttft_p99"] < best_p99)
    return "\n".join(lines) + "\n"
