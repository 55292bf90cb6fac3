"""NVIDIA Dynamo 1.6.1's own trace replay (its mocker engine + KV router), run beside kvgate's.

Dynamo needs Python 3.10 here (on 3.11 ``ai-dynamo`` pulls a package that downloads from an
unreachable host), so it gets its own venv under the engines directory; the replay runs in a
subprocess and hands back its summary as JSON.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kvgate.dev.engines import EngineError, ensure_venv

DYNAMO_SPEC = "ai-dynamo==1.6.1"

_SCRIPT = r"""
import json, sys, time
from dynamo.replay import run_trace_replay
a = json.loads(sys.argv[1])
t0 = time.time()
rep = run_trace_replay(a["trace"], extra_engine_args=a["engine"] or None, num_workers=a["workers"],
                       router_mode=a["mode"], arrival_speedup_ratio=a["speedup"], trace_block_size=512,
                       trace_format="mooncake", report_jsonl_path=a["jsonl"])
s = dict(rep.summary); s["_wall_s"] = time.time() - t0
print("KVGATE_RESULT " + json.dumps(s, default=str))
"""


def python310() -> str | None:
    """A working 3.10 interpreter: pyenv's installs first (its shim fails when 3.10 is not selected)."""
    root = Path(os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv")))
    cands = [str(p) for p in sorted(root.glob("versions/3.10*/bin/python3.10"))]
    if shutil.which("python3.10"):
        cands.append(str(shutil.which("python3.10")))
    for cand in cands:
        if subprocess.run([cand, "--version"], capture_output=True).returncode == 0:
            return cand
    return None


@dataclass(frozen=True)
class DynamoRun:
    mode: str
    workers: int
    speedup: float
    reuse: float
    ttft_mean_ms: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    output_tok_s: float
    wall_s: float
    arrivals_ms: tuple[float, ...] = ()
    """Per request, in trace order of completion records: arrival and TTFT (its per-request report)."""
    ttfts_ms: tuple[float, ...] = ()


def ensure_dynamo() -> Path:
    py = python310()
    if py is None:
        raise EngineError("Dynamo's replay needs a Python 3.10 interpreter (pyenv 3.10) and none was found")
    return ensure_venv("venv-dynamo", [DYNAMO_SPEC], python=py).venv


def run_dynamo(trace: Path, workers: int, mode: str, speedup: float = 1.0, num_gpu_blocks: int | None = None,
               timeout_s: float = 600) -> DynamoRun:
    venv = ensure_dynamo()
    with tempfile.TemporaryDirectory() as tmp:
        per_request = Path(tmp) / "requests.jsonl"
        args = {"trace": str(trace.resolve()), "workers": workers, "mode": mode, "speedup": speedup,
                "jsonl": str(per_request),
                "engine": {"engine": {"num_gpu_blocks": num_gpu_blocks}} if num_gpu_blocks else None}
        r = subprocess.run([str(venv / "bin" / "python"), "-c", _SCRIPT, json.dumps(args)], capture_output=True,
                           text=True, timeout=timeout_s, cwd=tmp)
        line = next((x for x in r.stdout.splitlines() if x.startswith("KVGATE_RESULT ")), None)
        if r.returncode != 0 or line is None:
            raise EngineError(f"dynamo replay failed ({r.returncode}): {(r.stderr or r.stdout)[-2000:]}")
        recs = [json.loads(x) for x in per_request.read_text().splitlines() if x.strip()]
    s = json.loads(line.removeprefix("KVGATE_RESULT "))
    done = [x for x in recs if x.get("ttft_ms") is not None]
    return DynamoRun(mode, workers, speedup, float(s["prefix_cache_reused_ratio"]), float(s["mean_ttft_ms"]),
                     float(s["median_ttft_ms"]), float(s["p99_ttft_ms"]), float(s["output_throughput_tok_s"]),
                     float(s["_wall_s"]), tuple(float(x["arrival_time_ms"]) for x in done),
                     tuple(float(x["ttft_ms"]) for x in done))
