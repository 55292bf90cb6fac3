"""The workloads in the repository's ``data/`` folder (each with its license and NOTICE), read compressed.

The benchmark harness is not part of the installed package, and neither is ``data/``: both live in a
source checkout, so the folder is found beside the package.
"""

from __future__ import annotations

import gzip
from pathlib import Path
from typing import TextIO

DATA_DIR = Path(__file__).resolve().parents[2] / "data"
MOONCAKE_TRACE = DATA_DIR / "mooncake" / "conversation_trace.jsonl.gz"
SWE_TRAJECTORIES = DATA_DIR / "swe-agent-trajectories"
AGENTIC_OTEL = DATA_DIR / "agentic-otel"


def open_text(path: Path) -> TextIO:
    """A text stream of ``path``, decompressed on the fly when it ends in ``.gz``."""
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def read_text(path: Path) -> str:
    with open_text(path) as f:
        return f.read()
