"""Outside load generators, each in its own virtualenv beside the engines (``kvgate.dev.engines``).

AIPerf (NVIDIA) is the one: on Python 3.11 without a GPU it installs without torch (transformers only,
for the tokenizer); inference-perf needs Python >= 3.12 and guidellm brings a CUDA torch. The version
is pinned so its record format, which ``kvgate.bench.loadgen`` parses, does not move under it.
"""

from __future__ import annotations

from pathlib import Path

from kvgate.dev.engines import InstallReport, engines_dir, ensure_venv

AIPERF_SPEC = "aiperf==0.13.0"
LOADGENS = {"aiperf": AIPERF_SPEC}


def ensure_loadgen(name: str = "aiperf") -> InstallReport:
    """Install (once, file-locked: another process may be installing it now) and return the venv."""
    return ensure_venv(f"venv-{name}", [LOADGENS[name]])


def loadgen_bin(name: str = "aiperf") -> Path:
    return engines_dir() / f"venv-{name}" / "bin" / name
