"""kvgate tune: a log recorded from a real gateway in front of simulated workers, replayed in virtual time
with the current settings (its fidelity) and with candidates; the table, the grid, the PATCH body."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvgate.cli import main
from kvgate.demo import run_demo
from kvgate.tune.log import LogError, read_logs, sessions
from kvgate.tune.replay import parse_overrides, recorded
from kvgate.tune.report import default_grid, grid_candidates, patch_body, tune


@pytest.fixture(scope="module")
def demo_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Six agents with tool waits through a gateway and three simulated workers (ten times real speed).
    They start 30 ms apart: agents started in the same millisecond share their system prompt or not
    depending on whether the engine schedules their first prefills in one step (which the gateway's own
    speed decides, and the replay, which does not model the gateway, cannot know)."""
    import asyncio

    path = tmp_path_factory.mktemp("tune") / "requests.log"
    asyncio.run(run_demo(3, speed=10.0, agents=6, tool_s=0.05, stagger_s=0.03, request_log=str(path), quiet=True))
    return path


def test_the_log_rebuilds_every_prompt(demo_log: Path) -> None:
    data = read_logs([demo_log])
    model, sess = sessions(data)
    assert model == "kvgate-tiny" and len(sess) == 6
    for s in sess:
        for t in s.turns:
            assert len(t.hashes) == t.e.prompt // t.e.block_size  # every full block of every prompt
        for a, b in zip(s.turns, s.turns[1:], strict=False):
            # A later prompt starts with the earlier one's blocks, then the reply's the engine cached.
            assert b.hashes[:len(a.hashes)] == a.hashes or b.e.common < len(a.hashes)
            assert a.output_hashes == b.hashes[len(a.hashes):b.e.common]


def test_the_recorded_run_replays_to_its_cached_tokens(demo_log: Path) -> None:
    text, rows = tune([demo_log], speed=10.0, candidates=["waits.reserve_max_s=0", "cost.affinity_cache_fraction=1"],
                      progress=False)
    _, sess = sessions(read_logs([demo_log]))
    rec = recorded(sess)
    current = rows[0].out
    assert current.requests == rec.requests == sum(s.rounds() for s in sess)
    # Fidelity: the replay reuses what the gateway's workers reported reusing, within a few percent.
    assert abs(current.cached_tokens - rec.cached_tokens) <= 0.05 * rec.cached_tokens, text
    assert "fidelity" in text and "cached tokens  replay" in text
    assert [r.name for r in rows] == ["current", "waits.reserve_max_s=0", "cost.affinity_cache_fraction=1"]
    # The current settings reserve the KV of short tool waits; a threshold of 0 reserves nothing.
    assert current.kv_parked_tokens > 0 and rows[1].out.kv_parked_tokens == 0
    table = text.split("\n\n")[2].splitlines()
    assert table[0].split()[:3] == ["candidate", "reuse", "TTFT"] and len(table) == 2 + len(rows)
    verdict = [ln for ln in text.splitlines() if ln.startswith(("best by mean TTFT", "keep the current settings"))]
    assert len(verdict) == 1
    # A better candidate comes with the request that applies it.
    assert verdict[0].startswith("keep") or text.splitlines()[-1].startswith("apply: curl -X PATCH")


def test_the_sweep_searches_the_grid_and_proposes_a_patch(demo_log: Path) -> None:
    grid = {"waits.reserve_max_s": [0.0, 5.0], "cost.backlog_weight": [0.0, 1.0, 4.0]}
    text, rows = tune([demo_log], speed=10.0, grid=grid, objective="ttft_p99", progress=False)
    assert len(rows) == 1 + 6
    best = min(rows[1:], key=lambda r: r.out.ttft_p99_ms)
    if best.out.ttft_p99_ms < rows[0].out.ttft_p99_ms * 0.99:
        line = next(x for x in text.splitlines() if x.startswith("apply: "))
        assert json.loads(line.split("-d '")[1].rstrip("'")) == patch_body(best.over)
    assert len(grid_candidates(default_grid(prefill=False))) == 12
    assert len(grid_candidates(default_grid(prefill=True))) == 36


def test_overrides_and_patch_bodies() -> None:
    over = parse_overrides("cost.backlog_weight=0.5, waits.reserve_max_s=2,cpu_tier_ttl_s=60")
    assert over == {"cost": {"backlog_weight": 0.5}, "waits": {"reserve_max_s": 2.0}, "cpu_tier_ttl_s": 60.0}
    assert patch_body(over) == {"cost": {"backlog_weight": 0.5}, "waits": {"reserve_max_s": 2.0}}
    for bad in ("warp.factor=1", "cost.backlog_weight", "cpu_tier_ttl_s.x=1"):
        with pytest.raises(ValueError):
            parse_overrides(bad)


def test_cli_prints_the_table_and_rejects_what_is_not_a_log(demo_log: Path, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    main(["tune", str(demo_log), "--speed", "10", "--candidate", "waits.reserve_max_s=1"])
    out = capsys.readouterr().out
    assert "fidelity" in out and "waits.reserve_max_s=1" in out
    bogus = tmp_path / "not-a-log"
    bogus.write_text('{"hello": 1}\n')
    with pytest.raises(SystemExit) as e:
        main(["tune", str(bogus)])
    assert e.value.code == 2 and "kvgate tune:" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["tune", str(demo_log), "--candidate", "waits.quantile=7"])  # validated before any replay
    with pytest.raises(LogError):
        read_logs([bogus])
