"""``kvgate bench tenants --quick`` runs and prints its table (its shape only: timings are the bench's
to report, not a test's to assert)."""

from __future__ import annotations

import pytest

from kvgate.bench.tenants import PHASES
from kvgate.cli import main


def test_quick_tenants_bench_prints_one_row_per_phase(capsys: pytest.CaptureFixture[str]) -> None:
    main(["--log-level", "WARNING", "bench", "tenants", "--quick"])
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("| seed |"))
    cols = [c.strip() for c in header.strip("|").split("|")]
    assert cols[:5] == ["seed", "phase", "light n", "light TTFT p50 (ms)", "p99 (ms)"]
    assert {"heavy 429", "heavy 503", "p99 / solo"} <= set(cols)
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in out.splitlines()
            if line.startswith("| 1 |")]
    assert [r[1] for r in rows] == [ph.name for ph in PHASES]
    assert all(len(r) == len(cols) for r in rows)
    assert rows[0][5] == rows[0][6] == "1.00"  # solo against itself
    assert rows[0][7] == "-" and rows[1][8].isdigit() and rows[2][8].isdigit()
    assert all(int(r[2]) > 0 for r in rows)  # every phase measured some light requests
