"""``kvgate bench overhead --loadgen aiperf``: what each router adds, measured by a load generator the project
did not write.

AIPerf (NVIDIA, pinned in ``kvgate.dev.loadgen``) sends the same traffic to every target: one multi-turn
dataset file per rate (agent sessions with a shared system prompt; AIPerf keeps each session's history and
sends the live answers back, so every turn grows), the same seed, the same Poisson rate, streamed chat
completions, the session key as ``x-session-id`` (kvgate, vllm-router's consistent hash). Targets: a simulated
worker straight (the baseline), kvgate, sglang-router and vllm-router, each in front of its own fresh identical
worker. Routers are pinned to core 0; workers and AIPerf to core 1. All targets are up for the whole sweep
and the rates go round them in turn, so the baseline at a rate is measured minutes, not a quarter of an hour,
from the routers at that rate on this shared machine.

Added TTFT / ITL = the router's percentile minus the direct run's percentile at the same rate (the runs are
not paired request by request). Percentiles are computed from AIPerf's per-request records
(``profile_export.jsonl``) the way AIPerf computes its own: linear interpolation between order statistics
(``aiperf.metrics.metric_dicts.metric_result_from_array``); ITL is AIPerf's per-request ITL, (latency − TTFT)
/ (output tokens − 1). CPU per request is the router process's (and its children's) user + system time from
/proc over the run, divided by the requests completed. The multi-turn slice puts each router in front of four
workers and reads reuse from the workers' ``usage.prompt_tokens_details.cached_tokens`` as AIPerf records it;
its direct row is AIPerf's own multi-URL mode, which deals sessions round robin and keeps each on its worker
(an ideal sticky router with no cost of its own).
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvgate.bench.overhead import MODEL, _cpu_s, _router_cmd, _spawn, upstream_client
from kvgate.dev.loadgen import AIPERF_SPEC, ensure_loadgen, loadgen_bin
from kvgate.serving import free_port
from kvgate.tokens.tinymodel import WORDS, ensure_tiny_model

DIRECT = "direct"
KVGATE_2 = "kvgate (serve --workers 2)"
REDIS_URL = "redis://127.0.0.1:6379/0"
ROUTERS = ("kvgate", "sglang-router cache_aware", "vllm-router cache_aware", "vllm-router consistent_hash")
RATES = (10.0, 50.0, 100.0, 200.0)
ADDED_P99_TTFT_LIMIT_MS = 50.0
ANSWER_TOKENS = 16
SESSION_HEADER = "x-session-id"
SYSTEM_PROMPT = "You are a coding agent working in a repository. " + "Be careful. " * 60


@dataclass(frozen=True, slots=True)
class Record:
    """One request as AIPerf recorded it."""

    ok: bool
    ttft_ms: float
    """NaN for a failed request."""
    itl_ms: float
    """AIPerf's per-request inter-token latency; NaN when it has none (failed, or one output token)."""
    prompt_tokens: int
    cached_tokens: int
    start_ns: int
    end_ns: int
    error_code: int | None = None
    """The HTTP status AIPerf recorded for a failed request (None: succeeded, or failed without one)."""


@dataclass(frozen=True)
class Run:
    target: str
    rate: float
    records: list[Record]
    cpu_s: float | None
    """The router's CPU seconds over the run; None for the direct baseline."""

    @property
    def ok(self) -> list[Record]:
        return [r for r in self.records if r.ok]

    def cpu_ms_per_request(self) -> float | None:
        return None if self.cpu_s is None or not self.ok else self.cpu_s * 1000 / len(self.ok)

    def achieved_rate(self) -> float:
        ok = self.ok
        if len(ok) < 2:
            return 0.0
        span_s = (max(r.start_ns for r in ok) - min(r.start_ns for r in ok)) / 1e9
        return (len(ok) - 1) / span_s if span_s > 0 else 0.0


def aiperf_pct(xs: Sequence[float], q: float) -> float:
    """AIPerf 0.13's percentile: linear interpolation at rank q·(n − 1) (numpy's default)."""
    s = sorted(x for x in xs if not math.isnan(x))
    if not s:
        return math.nan
    i = q * (len(s) - 1)
    lo = int(i)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (i - lo) * (s[hi] - s[lo])


# -- traffic ---------------------------------------------------------------------------------------------
def write_sessions(path: Path, n_sessions: int, n_turns: int, seed: int, tag: str) -> Path:
    """An AIPerf ``multi_turn`` file: agent sessions whose user turns are ~110 tool-result-like words; the
    shared system prompt is a leading system turn, which AIPerf sends ahead of every turn of the session."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for s in range(n_sessions):
            turns = [{"role": "system", "text": SYSTEM_PROMPT}]
            turns += [{"text": f"step {t}: " + " ".join(rng.choice(WORDS) for _ in range(110))}
                      for t in range(n_turns)]
            f.write(json.dumps({"session_id": f"{tag}-s{s:04d}", "turns": turns}) + "\n")
    return path


def sessions_needed(rate: float, seconds: float, n_turns: int) -> int:
    # Arrivals start a new session only when no session waits for its next turn, so the count depends on
    # latency; twice the lower bound, plus some, keeps AIPerf from wrapping onto a session already sent.
    return 2 * math.ceil(rate * seconds / n_turns) + 8


# -- the generator ---------------------------------------------------------------------------------------
def aiperf_cmd(urls: Sequence[str], dataset: Path, rate: float, seconds: float, seed: int, out: Path,
               tokenizer: Path) -> list[str]:
    cmd = [str(loadgen_bin("aiperf")), "profile", "--model", MODEL, "--tokenizer", str(tokenizer),
           "--endpoint-type", "chat", "--streaming", "--input-file", str(dataset),
           "--custom-dataset-type", "multi_turn", "--dataset-sampling-strategy", "sequential",
           "--request-rate", f"{rate:g}", "--arrival-pattern", "poisson", "--random-seed", str(seed),
           "--benchmark-duration", f"{seconds:g}", "--benchmark-grace-period", "60",
           "--osl", str(ANSWER_TOKENS), "--use-server-token-count", "--session-header", SESSION_HEADER,
           # The simulated worker's script: a plain answer of fixed length, no reasoning, so every target
           # streams the same tokens.
           "--extra-inputs", json.dumps({"sim": {"reasoning_tokens": 0, "answer_tokens": ANSWER_TOKENS}}),
           "--export-level", "records", "--artifact-dir", str(out), "--ui-type", "none",
           # AIPerf would otherwise scrape the target's /metrics during the run: load on the router under test.
           "--no-server-metrics", "--no-gpu-telemetry"]
    for u in urls:
        cmd += ["--url", u]
    return cmd


def read_records(path: Path) -> list[Record]:
    out = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        d = json.loads(line)
        m, meta = d.get("metrics") or {}, d.get("metadata") or {}

        def val(key: str, m: dict[str, dict[str, float]] = m) -> float:
            v = m.get(key)
            return float(v["value"]) if isinstance(v, dict) and v.get("value") is not None else math.nan

        ttft = val("time_to_first_token")
        err = d.get("error")
        ok = err is None and not math.isnan(ttft)
        code = err.get("code") if isinstance(err, dict) else None
        cached, prompt = val("usage_prompt_cache_read_tokens"), val("usage_prompt_tokens")
        out.append(Record(ok, ttft, val("inter_token_latency"), 0 if math.isnan(prompt) else int(prompt),
                          0 if math.isnan(cached) else int(cached), int(meta.get("request_start_ns") or 0),
                          int(meta.get("request_end_ns") or 0), code if isinstance(code, int) else None))
    return out


def run_aiperf(urls: Sequence[str], dataset: Path, rate: float, seconds: float, seed: int, out: Path,
               tokenizer: Path) -> list[Record]:
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    cmd = aiperf_cmd(urls, dataset, rate, seconds, seed, out, tokenizer)
    if shutil.which("taskset"):
        cmd = ["taskset", "-c", "1", *cmd]
    with open(out.parent / f"{out.name}.log", "wb") as log:
        r = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=seconds + 300, check=False)
    records = out / "profile_export.jsonl"
    if r.returncode != 0 or not records.exists():
        raise RuntimeError(f"aiperf failed ({r.returncode}); see {out.parent / f'{out.name}.log'}")
    return read_records(records)


# -- the processes ---------------------------------------------------------------------------------------
@dataclass
class Stack:
    """One target: its workers and (unless direct) the router in front of them."""

    name: str
    urls: list[str]
    procs: list[subprocess.Popen[bytes]]
    router: subprocess.Popen[bytes] | None

    def cpu_s(self) -> float | None:
        return None if self.router is None else _cpu_s(self.router.pid)


def kvgate_has_workers_option() -> bool:
    """``kvgate serve --workers N`` (several gateway processes) is another branch's work: the row for it
    appears once this checkout's ``serve`` offers the option."""
    r = subprocess.run([sys.executable, "-m", "kvgate.cli", "serve", "--help"], capture_output=True, text=True,
                       timeout=60, check=False)
    return re.search(r"--workers\b", r.stdout) is not None


def _wait_ready(url: str, procs: Sequence[subprocess.Popen[bytes]], timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            raise RuntimeError(f"a process exited before {url} was ready")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    raise TimeoutError(url)


def _warm(url: str, n: int = 3) -> None:
    """A few requests before the first measured one, so a router's first connections to its worker (and
    its lazy start-up work) are not counted in the first rate's tail."""
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "warm up"}], "max_tokens": 4,
                       "sim": {"reasoning_tokens": 0, "answer_tokens": 4}}).encode()
    deadline = time.monotonic() + 60
    for i in range(n):
        req = urllib.request.Request(url + "/v1/chat/completions", body, {"content-type": "application/json",
                                                                         SESSION_HEADER: f"warm-{i}"})
        while True:
            try:
                with urllib.request.urlopen(req, timeout=30) as r:
                    r.read()
                break
            except urllib.error.HTTPError as e:
                # A router that sheds load (kvgate's overload_shed_lag_ms) may refuse while its start-up
                # work still has the loop late: wait as told, as a client would.
                if e.code not in (429, 503) or time.monotonic() > deadline:
                    raise
                time.sleep(min(5.0, float(e.headers.get("retry-after") or 1)))


def _sim_env(model: Path) -> dict[str, str]:
    return {"KVGATE_TOKENIZERS": json.dumps({MODEL: str(model)}), "KVGATE_SIM_MAX_MODEL_LEN": "131072"}


def start_stack(name: str, n_workers: int, out: Path, model: Path, tag: str, extra: Sequence[str] = ()
                ) -> Stack:
    """``extra``: more of the router's command-line options."""
    # Four times an H100's speed, as in the paired bench: the engines must not be what limits the rate.
    sim = [sys.executable, "-m", "kvgate.cli", "--log-level", "WARNING", "sim", "--model-dir", str(model),
           "--profile", "h100-llama3-8b", "--block-size", "16", "--speed", "4"]
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    ports = [free_port() for _ in range(n_workers)]
    procs = [_spawn([*sim, "--port", str(p)], "1", out / f"{tag}-{slug}-sim{i}.log", _sim_env(model))
             for i, p in enumerate(ports)]
    workers = [f"http://127.0.0.1:{p}" for p in ports]
    stack = Stack(name, workers, procs, None)
    try:
        for w in workers:
            _wait_ready(w + "/health", procs)
        if name == DIRECT:
            return stack
        port = free_port()
        cmd, ready = _router_cmd(name.removesuffix(" (serve --workers 2)"), port, workers)
        cmd += extra
        cores = "0"
        if name == KVGATE_2:
            # Its processes share conversations through Redis (they refuse the memory store), and get both
            # cores, the workers' one included: on a 2-core machine this row shows the processes acting as
            # one under load, not the 1.8x a pod with two free cores would give.
            cmd += ["--workers", "2", "--session-store", "redis", "--redis-url", REDIS_URL,
                    "--redis-prefix", f"kvgate-bench-{uuid.uuid4().hex[:8]}:"]
            cores = "0,1"
        stack.router = _spawn(cmd, cores, out / f"{tag}-{slug}.log",
                              {**_sim_env(model), "KVGATE_UPSTREAM_CLIENT": upstream_client(name)})
        procs.append(stack.router)
        stack.urls = [f"http://127.0.0.1:{port}"]
        _wait_ready(stack.urls[0] + ready, procs)
        _warm(stack.urls[0])
        return stack
    except BaseException:
        stop(stack)
        raise


def stop(stack: Stack) -> None:
    for p in stack.procs:
        p.terminate()
    for p in stack.procs:
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()


@contextlib.contextmanager
def stacks(names: Sequence[str], n_workers: int, out: Path, model: Path, tag: str,
           extra: Mapping[str, Sequence[str]] | None = None) -> Iterator[list[Stack]]:
    up: list[Stack] = []
    try:
        for n in names:
            up.append(start_stack(n, n_workers, out, model, tag, (extra or {}).get(n, ())))
            print(f"  {tag}: {n} up at {up[-1].urls[0]}", file=sys.stderr)
        yield up
    finally:
        for s in up:
            stop(s)


def measure(stack: Stack, dataset: Path, rate: float, seconds: float, seed: int, out: Path, tokenizer: Path,
            tag: str) -> Run:
    c0 = stack.cpu_s()
    slug = re.sub(r"[^a-z0-9]+", "-", stack.name.lower()).strip("-")
    try:
        records = run_aiperf(stack.urls, dataset, rate, seconds, seed, out / f"aiperf-{tag}-{slug}-{rate:g}",
                             tokenizer)
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        # One target's failed run must not cost the others' figures: it shows as a row with no requests.
        print(f"  {tag} {stack.name} at {rate:g}/s: {exc}", file=sys.stderr)
        records = []
    c1 = stack.cpu_s()
    run = Run(stack.name, rate, records, None if c0 is None or c1 is None else c1 - c0)
    print(f"  {tag} {stack.name} at {rate:g}/s: {len(run.ok)} ok, {len(records) - len(run.ok)} failed, "
          f"TTFT p99 {aiperf_pct([r.ttft_ms for r in run.ok], .99):.1f} ms", file=sys.stderr)
    return run


def sweep(names: Sequence[str], rates: Sequence[float], seconds: float, out: Path, seed: int = 7,
          n_turns: int = 40) -> dict[str, dict[float, Run]]:
    """Every target at every rate on identical traffic, one worker behind each router."""
    model = ensure_tiny_model()
    results: dict[str, dict[float, Run]] = {n: {} for n in names}
    with stacks(names, 1, out, model, "rate") as up:
        for rate in rates:
            data = write_sessions(out / f"aiperf-sessions-{rate:g}.jsonl", sessions_needed(rate, seconds, n_turns),
                                  n_turns, seed + int(rate), f"r{rate:g}")
            for s in up:
                results[s.name][rate] = measure(s, data, rate, seconds, seed, out, model, "rate")
    return results


def multiturn(names: Sequence[str], rate: float, seconds: float, out: Path, seed: int = 11,
              n_turns: int = 12) -> dict[str, Run]:
    """Each target in front of four workers; direct is AIPerf's own per-request round robin over them."""
    model = ensure_tiny_model()
    data = write_sessions(out / "aiperf-sessions-multiturn.jsonl", 3 * math.ceil(rate * seconds / n_turns) + 8,
                          n_turns, seed, "mt")
    with stacks(names, 4, out, model, "multiturn") as up:
        return {s.name: measure(s, data, rate, seconds, seed, out, model, "multiturn") for s in up}


# -- the report ------------------------------------------------------------------------------------------
def _pp(xs: Sequence[float]) -> tuple[float, float]:
    return aiperf_pct(xs, .5), aiperf_pct(xs, .99)


def added(run: Run, base: Run | None) -> tuple[float, float, float, float]:
    """Added TTFT p50, p99 and ITL p50, p99 over the direct run at the same rate."""
    if base is None:
        return (math.nan,) * 4
    t, tb = _pp([r.ttft_ms for r in run.ok]), _pp([r.ttft_ms for r in base.ok])
    i, ib = _pp([r.itl_ms for r in run.ok]), _pp([r.itl_ms for r in base.ok])
    return t[0] - tb[0], t[1] - tb[1], i[0] - ib[0], i[1] - ib[1]


def rate_table(results: dict[str, dict[float, Run]]) -> str:
    lines = ["| target | rate (req/s) | requests ok / failed | achieved req/s | TTFT p50 / p99 (ms) | added TTFT "
             "p50 / p99 | ITL p50 / p99 (ms) | added ITL p50 / p99 | router CPU per request (ms) | req/s at one "
             "full core |", "|---|---|---|---|---|---|---|---|---|---|"]
    base = results.get(DIRECT, {})
    for name, by_rate in results.items():
        for rate, run in by_rate.items():
            ok = run.ok
            t, i = _pp([r.ttft_ms for r in ok]), _pp([r.itl_ms for r in ok])
            a = added(run, base.get(rate)) if name != DIRECT else (math.nan,) * 4
            cpu = run.cpu_ms_per_request()
            lines.append(f"| {name} | {rate:g} | {len(ok)} / {len(run.records) - len(ok)} | {run.achieved_rate():.1f} "
                         f"| {t[0]:.1f} / {t[1]:.1f} | {_signed(a[0])} / {_signed(a[1])} | {i[0]:.2f} / {i[1]:.2f} | "
                         f"{_signed(a[2], 2)} / {_signed(a[3], 2)} | {'' if cpu is None else f'{cpu:.2f}'} | "
                         f"{'' if not cpu else f'{1000 / cpu:.0f}'} |")
    return "\n".join(lines) + "\n"


def _signed(x: float, digits: int = 1) -> str:
    return "" if math.isnan(x) else f"{x:+.{digits}f}"


def sustained(results: dict[str, dict[float, Run]], limit_ms: float = ADDED_P99_TTFT_LIMIT_MS
              ) -> dict[str, float | None]:
    """Per router, the highest rate run whose added p99 TTFT stayed within ``limit_ms`` with every request
    answered and the generator reaching 80 % of the rate (Poisson over a short run spreads); None if none did."""
    base = results.get(DIRECT, {})
    out: dict[str, float | None] = {}
    for name, by_rate in results.items():
        if name == DIRECT:
            continue
        good = [rate for rate, run in by_rate.items()
                if run.ok and len(run.ok) == len(run.records) and run.achieved_rate() >= 0.8 * rate
                and added(run, base.get(rate))[1] <= limit_ms]
        out[name] = max(good) if good else None
    return out


def sustained_table(results: dict[str, dict[float, Run]]) -> str:
    lines = [f"| router | highest rate run with added p99 TTFT ≤ {ADDED_P99_TTFT_LIMIT_MS:g} ms (req/s, one core) | "
             "CPU-seconds per request at that rate (ms) |", "|---|---|---|"]
    for name, rate in sustained(results).items():
        cpu = results[name][rate].cpu_ms_per_request() if rate is not None else None
        lines.append(f"| {name} | {'none of the rates run' if rate is None else f'{rate:g}'} | "
                     f"{'' if cpu is None else f'{cpu:.2f}'} |")
    return "\n".join(lines) + "\n"


def multiturn_table(results: dict[str, Run]) -> str:
    lines = ["| target (4 workers) | requests ok / failed | reuse (cached / prompt tokens) | TTFT mean / p99 (ms) | "
             "router CPU per request (ms) |", "|---|---|---|---|---|"]
    for name, run in results.items():
        ok = run.ok
        prompt = sum(r.prompt_tokens for r in ok)
        reuse = sum(r.cached_tokens for r in ok) / prompt if prompt else math.nan
        ttft = [r.ttft_ms for r in ok]
        mean = sum(ttft) / len(ttft) if ttft else math.nan
        cpu = run.cpu_ms_per_request()
        label = "direct (AIPerf session-sticky round robin)" if name == DIRECT else name
        lines.append(f"| {label} | {len(ok)} / {len(run.records) - len(ok)} | {reuse:.1%} | {mean:.1f} / "
                     f"{aiperf_pct(ttft, .99):.1f} | {'' if cpu is None else f'{cpu:.2f}'} |")
    return "\n".join(lines) + "\n"


def plot(results: dict[str, dict[float, Run]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    base = results.get(DIRECT, {})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, by_rate in results.items():
        if name == DIRECT:
            continue
        rates = sorted(by_rate)
        a = [added(by_rate[r], base.get(r)) for r in rates]
        axes[0].plot(rates, [x[1] for x in a], marker="o", label=name)
        axes[1].plot(rates, [x[0] for x in a], marker="o", label=name)
    for ax, what in zip(axes, ("p99", "p50"), strict=True):
        ax.axhline(ADDED_P99_TTFT_LIMIT_MS if what == "p99" else 0, color="grey", lw=0.8, ls="--")
        ax.set_yscale("symlog", linthresh=10)  # tens of ms at low rates and seconds at saturation, one axis
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.set_xlabel("arrival rate (req/s, Poisson)")
        ax.set_ylabel(f"added TTFT {what} (ms, router − direct)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Added time to first token, measured by {AIPERF_SPEC} (router on one core)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(rates: dict[str, dict[float, Run]], mt: dict[str, Run] | None, seconds: float, load: str,
           overloaded: str | None = None) -> str:
    cores = "core 0" if shutil.which("taskset") else "any core (no taskset)"
    text = (f"## Measured with {AIPERF_SPEC}\n\nEach router pinned to {cores}; its worker and AIPerf on core 1. Same "
            f"multi-turn dataset file, seed and Poisson rate for every target, {seconds:g} s per rate; added = the "
            "router's percentile − the direct run's at the same rate (AIPerf's interpolated percentiles over its "
            f"per-request records). Machine load (uptime) at the end: {load}.\n\n" + rate_table(rates) + "\n"
            + sustained_table(rates))
    if mt is not None:
        text += "\nMulti-turn slice, four workers behind each router:\n\n" + multiturn_table(mt)
    if overloaded is not None:
        text += "\n" + overloaded
    return text


def _uptime() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"


def run(out: Path = Path("bench-out"), quick: bool = False, routers: Sequence[str] | None = None,
        rates: Sequence[float] | None = None, seconds: float | None = None, multiturn_slice: bool = True,
        overload: bool = True) -> str:
    """The sweep, the sustained-rate table, the multi-turn slice and kvgate at 3x its sustained rate
    (``bench.overload``); writes ``overhead-aiperf.md``, its section of ``overhead.md`` and
    ``overhead-aiperf.png``."""
    from kvgate.bench.overhead import write_section
    from kvgate.bench.overload import measure_overload, overload_table

    rep = ensure_loadgen("aiperf")
    print(f"aiperf: {'reused' if rep.reused else f'installed in {rep.seconds:.0f}s'} ({rep.venv})", file=sys.stderr)
    out.mkdir(parents=True, exist_ok=True)
    names = list(routers if routers is not None else (("kvgate",) if quick else ROUTERS))
    if routers is None and "kvgate" in names and kvgate_has_workers_option():
        names.insert(names.index("kvgate") + 1, KVGATE_2)
    rates = tuple(rates or ((10.0, 50.0) if quick else RATES))
    seconds = seconds or (6.0 if quick else 12.0)
    res = sweep([DIRECT, *names], rates, seconds, out)
    mt = multiturn([DIRECT, *names], 20.0, seconds * 1.5, out) if multiturn_slice else None
    over = None
    if overload and "kvgate" in res:
        # What kvgate sustained here, or the lowest rate run when it sustained none of them.
        held = sustained(res).get("kvgate")
        over = overload_table(measure_overload(held or min(rates), held is not None, seconds, out))
    text = report(res, mt, seconds, _uptime(), over)
    plot(res, out / "overhead-aiperf.png")
    (out / "overhead-aiperf.md").write_text(text)
    write_section(out / "overhead.md", "aiperf", text)
    print(text)
    return text
