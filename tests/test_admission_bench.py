"""``kvgate bench tenants``: its virtual-time fleet runs kvgate's admission as the gateway does (a heavy
tenant over its limit is refused, the light one is not), and both parts print their tables (their shape
only: timings are the bench's to report, not a test's to assert)."""

from __future__ import annotations

from pathlib import Path

from kvgate.bench import tenants, tenants_real
from kvgate.bench.tenantfleet import HEAVY, LIGHT, Mode, Workload, run

SMALL = Workload("small", seconds=8.0)


def test_the_virtual_fleet_admits_the_light_tenant_and_refuses_the_heavy_one_over_its_limit() -> None:
    on = run(SMALL, Mode("on", max_concurrent=4), 1)
    off = run(SMALL, Mode("off", admission=False), 1)
    assert set(on.statuses(LIGHT)) == {200} and on.statuses(HEAVY)[429] > 0
    assert set(off.statuses(HEAVY)) == {200}
    # Every admitted request got its first token and finished (the loop drains), and admission kept the
    # heavy backlog out of the engines: the light tenant's worst first token comes far sooner.
    assert all(r.first is not None and r.finish is not None for r in on.requests if r.status == 200)
    assert max(on.ttft_ms(LIGHT)) < max(off.ttft_ms(LIGHT)) / 2
    assert run(SMALL, Mode("on", max_concurrent=4), 1).ttft_ms(LIGHT) == on.ttft_ms(LIGHT)  # deterministic


def test_caps_learned_from_the_engines_hold_the_heavy_backlog_in_the_gateway() -> None:
    learned = run(SMALL, Mode("learned", max_concurrent=None, learned=True), 1)
    # Unlimited tenants, caps unknown until the engines are seen saturated: then the queue holds the rest
    # (503 once they wait too long) instead of the engines.
    assert learned.statuses(HEAVY).get(503, 0) > 0 and set(learned.statuses(LIGHT)) <= {200, 503}


def test_the_virtual_time_table_has_a_row_per_mode_against_its_solo(tmp_path: Path) -> None:
    modes = (Mode("admission on"), Mode("admission off", admission=False))
    cells = tenants.measure([SMALL], modes, [1], processes=1)
    text = tenants.table(cells, [SMALL], modes, [1])
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines()
            if line.startswith("| small |")]
    assert [r[1] for r in rows] == ["solo", "admission on", "admission off"]
    assert rows[0][5] == rows[0][6] == "1.00" and rows[0][8] == "-"
    assert int(rows[1][9]) > 0 and rows[2][9] == "0"  # heavy 429s only with admission on
    tenants.plot(cells, [SMALL], modes, [1], tmp_path / "cdf.png")
    assert (tmp_path / "cdf.png").stat().st_size > 0


def test_the_real_process_part_prints_a_row_per_phase(tmp_path: Path) -> None:
    text = tenants_real.run(tenants_real.Params(seconds=3.0), [1], tenants_real.PHASES[::3], run_dir=tmp_path)
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines() if line.startswith("| 1 |")]
    assert [r[1] for r in rows] == ["solo", "with heavy, admission on"]
    assert rows[0][5] == rows[0][6] == "1.00" and rows[0][7] == "-"
    assert all(int(r[2]) > 0 for r in rows) and rows[1][8].isdigit()
