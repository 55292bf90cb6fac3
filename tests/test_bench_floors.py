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


def test_tiered_floors_judge_kvgate_against_round_robin_and_the_pool_and_skip_reuse_when_it_fits() -> None:
    def rows(host_reuse: float, p99: float) -> list[dict[str, object]]:
        return [{"name": mooncake.LABELS["kvgate_precise"], "reuse": 0.5, "bound": 0.5},
                {"name": mooncake.LABELS["kvgate_tiers"], "reuse": 0.6, "bound": 0.5, "ttft_mean": 90.0,
                 "ttft_p99": p99},
                {"name": mooncake.LABELS["round_robin_pool"], "reuse": 0.6, "bound": 0.5, "ttft_mean": 100.0,
                 "ttft_p99": 500.0},
                {"name": "global LRU of GPU + CPU: one cache", "reuse": host_reuse, "reuse_only": True}]

    _, checked = mooncake.floors({"t": rows(0.7, 600.0)})
    by = {f.label: f.ok for f in checked}
    assert by["mean TTFT, kvgate with tiers / round robin + shared pool"] is True
    assert by["p99 TTFT, kvgate with tiers / round robin + shared pool"] is False
    assert by["kvgate with tiers reuse / global LRU of GPU capacity"] is True
    _, checked = mooncake.floors({"t": rows(0.5, 400.0)})  # everything fits in the GPUs: reuse not judged
    assert {f.label: f.ok for f in checked}["kvgate with tiers reuse / global LRU of GPU capacity"] is None
