"""`kvgate bench kvevents --quick`: the table's shape and that every figure is a positive number (not timed)."""

from __future__ import annotations

import re

import pytest

from kvgate.cli import main


def _rows(out: str, title: str) -> list[list[str]]:
    section = out.split(title, 1)[1].split("###", 1)[0]
    lines = [ln for ln in section.splitlines() if ln.startswith("|")]
    return [[c.strip() for c in ln.strip("|").split("|")] for ln in lines[2:]]  # past the header and rule


def _number(cell: str) -> float:
    m = re.fullmatch(r"[\d,]+(\.\d+)?", cell)
    assert m, cell
    return float(cell.replace(",", ""))


def test_quick_bench_prints_both_tables(capsys: pytest.CaptureFixture[str]) -> None:
    main(["bench", "kvevents", "--quick"])
    out = capsys.readouterr().out
    ingest = _rows(out, "KV event ingestion")
    assert len(ingest) == 4 and all(len(r) == 9 for r in ingest)
    assert {r[1] for r in ingest} >= {"1", "16", "256"}
    for r in ingest:
        assert all(_number(c) > 0 for c in r[1:8]), r
        assert r[8] == "≥ 500,000"
    route = _rows(out, "Routing a known conversation")
    assert [r[0] for r in route] == ["2,000", "8,000", "32,000"]
    for r in route:
        assert len(r) == 10 and all(_number(c) > 0 for c in r[1:9]), r
        assert r[9] == "≤ 1 ms p99"
