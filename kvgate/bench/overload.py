"""Overload, measured by AIPerf (issue 25's target: at 3x the sustainable rate every refusal is a 429/503 with
Retry-After, no healthy worker is ejected, and the admitted requests' added p99 TTFT stays within 50 ms).

kvgate with ``overload_shed_lag_ms`` set (the setting operators are told to use, ``docs/operations.md``) and the
direct baseline get the same AIPerf traffic as the sweep, at three times the highest rate kvgate sustained in
it. The admitted requests' added TTFT is over the direct worker run again at the rate kvgate admitted: at the
offered rate this bench's worker saturates too, and a difference of two queues says nothing. AIPerf records
each refusal's status; it does not keep response headers, so a probe beside it (one short request through
kvgate every quarter second, on the generator's core) checks that every refusal it meets carries
``Retry-After``. Whether a worker was ejected is read from kvgate's own ``/metrics`` after the run: a worker
out at the end (``kvgate_worker_healthy`` 0) or back after being out (``kvgate_worker_restarts``
``readmitted``), with the timeouts kvgate blamed on its late loop instead
(``kvgate_worker_timeouts_loop_blamed``) beside them.
"""

from __future__ import annotations

import json
import math
import re
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from kvgate.bench.loadgen import (
    ADDED_P99_TTFT_LIMIT_MS,
    DIRECT,
    SESSION_HEADER,
    Run,
    _pp,
    added,
    measure,
    sessions_needed,
    stacks,
    write_sessions,
)
from kvgate.bench.overhead import MODEL
from kvgate.tokens.tinymodel import ensure_tiny_model

SHED_LAG_MS = 30.0
KVGATE_SHED = f"kvgate (overload_shed_lag_ms {SHED_LAG_MS:g})"
SHED_ARGS = ("--overload-shed-lag-ms", f"{SHED_LAG_MS:g}")
REFUSALS = (429, 503)


@dataclass
class Probe:
    """One short request through the router every ``period_s`` while the load runs."""

    url: str
    period_s: float = 0.25
    statuses: Counter[int] = field(default_factory=Counter)
    refused_with_retry_after: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "probe"}], "max_tokens": 2,
                           "sim": {"reasoning_tokens": 0, "answer_tokens": 2}}).encode()
        i = 0
        while not self._stop.wait(self.period_s):
            i += 1
            req = urllib.request.Request(self.url + "/v1/chat/completions", body,
                                         {"content-type": "application/json", SESSION_HEADER: f"probe-{i}"})
            try:
                with urllib.request.urlopen(req, timeout=30) as r:
                    r.read()
                    self.statuses[r.status] += 1
            except urllib.error.HTTPError as e:
                self.statuses[e.code] += 1
                if e.code in REFUSALS and e.headers.get("retry-after"):
                    self.refused_with_retry_after += 1
            except (urllib.error.URLError, OSError):
                self.statuses[0] += 1

    def stop(self) -> None:
        self._stop.set()


@dataclass(frozen=True)
class Health:
    unhealthy_at_end: int
    readmitted: int
    loop_blamed: int
    shed: int


def scrape_health(url: str) -> Health:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()

    def total(pattern: str) -> float:
        return sum(float(m.group(1)) for m in re.finditer(pattern + r"(?:\{[^}]*\})? (\S+)$", text, re.M))

    return Health(
        unhealthy_at_end=sum(1 for m in re.finditer(r"^kvgate_worker_healthy\{[^}]*\} (\S+)$", text, re.M)
                             if float(m.group(1)) == 0),
        readmitted=int(sum(float(m.group(1)) for m in re.finditer(
            r'^kvgate_worker_restarts_total\{[^}]*signal="readmitted"[^}]*\} (\S+)$', text, re.M))),
        loop_blamed=int(total(r"^kvgate_worker_timeouts_loop_blamed_total")),
        shed=int(total(r"^kvgate_requests_shed_total")))


@dataclass(frozen=True)
class OverloadResult:
    rate: float
    sustainable: float
    """The rate it was three times: the highest kvgate sustained in the sweep, else the lowest run."""
    sustained: bool
    """Whether kvgate sustained ``sustainable`` in the sweep (False: it sustained none of the rates)."""
    run: Run
    base: Run | None
    """The direct worker at the rate kvgate admitted: what the admitted requests' added TTFT is measured
    against (at the offered rate the worker itself may saturate, and then "added" is a negative queue)."""
    offered: Run | None
    """The direct worker at the offered rate, for reference."""
    probe: Probe
    health: Health

    def refusals(self) -> Counter[int | None]:
        return Counter(r.error_code for r in self.run.records if not r.ok)

    def verdicts(self) -> dict[str, bool]:
        refused = self.refusals()
        probe_refused = sum(n for code, n in self.probe.statuses.items() if code in REFUSALS)
        probe_other = sum(n for code, n in self.probe.statuses.items() if code != 200 and code not in REFUSALS)
        return {
            "every refusal a 429/503": all(code in REFUSALS for code in refused) and probe_other == 0,
            "every refusal met by the probe carries Retry-After": probe_refused == self.probe.refused_with_retry_after,
            "no worker ejected": self.health.unhealthy_at_end == 0 and self.health.readmitted == 0,
            f"admitted added p99 TTFT <= {ADDED_P99_TTFT_LIMIT_MS:g} ms":
                self.base is not None and added(self.run, self.base)[1] <= ADDED_P99_TTFT_LIMIT_MS,
        }


def measure_overload(sustainable: float, sustained: bool, seconds: float, out: Path, factor: float = 3.0,
                     seed: int = 13, n_turns: int = 40) -> OverloadResult:
    rate = factor * sustainable
    model = ensure_tiny_model()
    data = write_sessions(out / f"aiperf-sessions-overload-{rate:g}.jsonl", sessions_needed(rate, seconds, n_turns),
                          n_turns, seed, f"o{rate:g}")
    with stacks([DIRECT, KVGATE_SHED], 1, out, model, "overload", {KVGATE_SHED: SHED_ARGS}) as up:
        direct, gw = up
        offered = measure(direct, data, rate, seconds, seed, out, model, "overload")
        probe = Probe(gw.urls[0])
        t = threading.Thread(target=probe.run, daemon=True)
        t.start()
        try:
            run = measure(gw, data, rate, seconds, seed, out, model, "overload")
        finally:
            probe.stop()
            t.join(timeout=35)
        time.sleep(1.0)  # a health poll that fired late is settled before the counters are read
        health = scrape_health(gw.urls[0])
        admitted = run.achieved_rate()
        base = (measure(direct, data, round(admitted, 1), seconds, seed, out, model, "overload-admitted")
                if admitted > 0 else None)
    return OverloadResult(rate, sustainable, sustained, run, base, offered, probe, health)


def overload_table(r: OverloadResult) -> str:
    ok, refused = r.run.ok, r.refusals()
    t = _pp([x.ttft_ms for x in ok])
    a = added(r.run, r.base)
    o = _pp([x.ttft_ms for x in r.offered.ok]) if r.offered is not None else (math.nan, math.nan)
    refused_s = ", ".join(f"{n} x {code if code is not None else 'no status'}"
                          for code, n in sorted(refused.items(), key=lambda kv: (kv[0] is None, kv[0] or 0)))
    probe = ", ".join(f"{n} x {code or 'no answer'}" for code, n in sorted(r.probe.statuses.items()))
    lines = [
        f"Overload: {KVGATE_SHED} at {r.rate:g} req/s, {r.rate / r.sustainable:g}x "
        + (f"the highest rate it sustained in the sweep ({r.sustainable:g} req/s):" if r.sustained else
           f"the lowest rate of the sweep ({r.sustainable:g} req/s; it sustained none):"), "",
        "| requests ok / refused | refusals by status | admitted req/s | admitted TTFT p50 / p99 (ms) | added p50 / "
        "p99 over direct at the admitted rate | direct at the offered rate TTFT p50 / p99 | probe answers | probe "
        "refusals with Retry-After | workers out at the end / readmitted | timeouts blamed on kvgate's loop | "
        "shed (503 overloaded) |", "|---|---|---|---|---|---|---|---|---|---|---|",
        f"| {len(ok)} / {len(r.run.records) - len(ok)} | {refused_s or 'none'} | {r.run.achieved_rate():.1f} | "
        f"{t[0]:.1f} / {t[1]:.1f} | {_fmt(a[0])} / {_fmt(a[1])} | {o[0]:.1f} / {o[1]:.1f} | {probe or 'none'} | "
        f"{r.probe.refused_with_retry_after} | "
        f"{r.health.unhealthy_at_end} / {r.health.readmitted} | {r.health.loop_blamed} | {r.health.shed} |", ""]
    lines += [f"- {name}: {'met' if good else '**missed**'}" for name, good in r.verdicts().items()]
    return "\n".join(lines) + "\n"


def _fmt(x: float) -> str:
    return "" if math.isnan(x) else f"{x:+.1f}"
