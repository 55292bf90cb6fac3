"""A benchmark that prints a failed floor fails: its exit code, and the reason on stderr."""

from __future__ import annotations

import pytest

from kvgate.bench import mooncake
from kvgate.bench.peers import Sample, _row
from kvgate.bench.report import Floor, floor_verdict


def _results(reuse: float) -> dict[str, object]:
    return {"trace — 8 workers": [{"name": mooncake.LABELS["kvgate_precise"], "reuse": reuse, "bound": 0.25}]}


def test_a_failed_mooncake_floor_is_exit_1_with_its_reason(capsys: pytest.CaptureFixture[str]) -> None:
    text, checked = mooncake.floors(_results(0.2398))  # 0.959 of the bound, the floor is 0.97
    assert "| NO |" in text
    assert floor_verdict("mooncake", checked) == 1
    err = capsys.readouterr().err
    assert err == ("kvgate bench mooncake: floor failed: trace — 8 workers: kvgate precise reuse / global LRU "
                   "measured 0.959, target ≥ 0.97\n")


def test_floors_that_hold_or_cannot_be_judged_are_exit_0(capsys: pytest.CaptureFixture[str]) -> None:
    _, checked = mooncake.floors(_results(0.2449))
    assert [f.ok for f in checked] == [True]
    assert floor_verdict("mooncake", [*checked, Floor("t", "shown, not judged", 0.5, "≤ 0.3", None)]) == 0
    assert capsys.readouterr().err == ""


def test_failed_peer_requests_say_why() -> None:
    ok = Sample(100.0, 1000, 500, 10, True)
    bad = [Sample(0.0, 0, 0, 0, False, "503 {\"error\": {\"message\": \"no healthy worker\"}}")] * 2
    row = _row("kvgate cost_model", [ok, *bad, Sample(0.0, 0, 0, 0, False, "ReadTimeout('')")], 1.0)
    assert row.name == 'kvgate cost_model (3 failed; 2x: 503 {"error": {"message": "no healthy worker"}})'
