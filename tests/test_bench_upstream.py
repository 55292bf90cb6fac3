"""`kvgate bench upstream --quick`: every client reads every answer whole, and the table says so (not timed)."""

from __future__ import annotations

import pytest

from kvgate.bench.upstream import CLIENTS, EVENTS
from kvgate.cli import main


def test_quick_bench_prints_a_row_per_client_and_answer(capsys: pytest.CaptureFixture[str]) -> None:
    main(["bench", "upstream", "--quick"])
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("|")][2:]
    rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in lines]
    assert [(r[0], int(r[1])) for r in rows] == [(c, e) for e in EVENTS for c in CLIENTS]
    for r in rows:
        assert float(r[2]) > 0 and float(r[4]) > 0 and float(r[5]) > 0, r
