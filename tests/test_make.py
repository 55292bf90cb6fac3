"""`make test` as a newcomer runs it: every part runs even when one fails, and the setup it does first."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_make_test_runs_every_part_and_names_the_failed_ones(tmp_path: Path) -> None:
    # Stand-in parts (the real ones take minutes): the Makefile's own `test` recipe drives them.
    extra = tmp_path / "parts.mk"
    extra.write_text(f"ok-a:\n\t@touch {tmp_path}/a\nbad-b:\n\t@exit 3\nok-c:\n\t@touch {tmp_path}/c\n"
                     "bad-d:\n\t@false\n")
    r = subprocess.run(["make", "--no-print-directory", "-f", "Makefile", "-f", str(extra), "test",
                        "TEST_PARTS=ok-a bad-b ok-c bad-d"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "KVGATE_TEST_DEPS_INSTALL": "0"})
    assert r.returncode != 0
    assert (tmp_path / "a").exists() and (tmp_path / "c").exists(), "a part after a failed one did not run"
    assert "make test: FAILED: bad-b bad-d (of ok-a bad-b ok-c bad-d)" in r.stderr, r.stderr


def test_make_test_passes_when_every_part_does(tmp_path: Path) -> None:
    extra = tmp_path / "parts.mk"
    extra.write_text("ok-a:\n\t@true\nok-b:\n\t@true\n")
    r = subprocess.run(["make", "--no-print-directory", "-f", "Makefile", "-f", str(extra), "test",
                        "TEST_PARTS=ok-a ok-b"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "KVGATE_TEST_DEPS_INSTALL": "0"})
    assert r.returncode == 0, r.stderr
    assert "make test: all passed (ok-a ok-b)" in r.stdout


def test_ci_run_is_make_test_and_make_test_sets_up_its_binaries() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    assert [ln for ln in ci.splitlines() if ln and not ln.startswith("#")][-1] == "make test"
    dry = subprocess.run(["make", "-n", "test"], cwd=ROOT, capture_output=True, text=True, timeout=60).stdout
    assert "./scripts/test-deps.sh" in dry


def test_setup_without_apt_names_what_is_missing_and_what_it_skips(tmp_path: Path) -> None:
    # A PATH with the shell tools and redis-cli but no prometheus: the script cannot install (told not to)
    # and must say what that costs, then succeed so the suite still runs.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "id", "seq", "sleep", "redis-cli", "redis-server"):
        found = shutil.which(tool)
        if found:
            (bin_dir / tool).symlink_to(found)
    r = subprocess.run([str(ROOT / "scripts" / "test-deps.sh")], capture_output=True, text=True, timeout=60,
                       env={"PATH": str(bin_dir), "KVGATE_TEST_DEPS_INSTALL": "0"})
    assert r.returncode == 0, r.stderr
    assert "prometheus/promtool not installed" in r.stderr and "KVGATE_PROMETHEUS_TESTS=0" in r.stderr, r.stderr
