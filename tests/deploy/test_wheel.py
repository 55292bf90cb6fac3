"""The runtime as the image installs it: the wheel built from the Docker build context alone, installed
into a clean venv exactly as the Dockerfile's runtime stage does (same constraints file, wheels only),
then `kvgate sim` and `kvgate serve` from that venv serve a completion. Nothing from the checkout is
importable there: the processes run from a scratch directory with a clean environment.

Fast on a second run: pip's cache holds the wheels (about 10 s here).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import free_port
from tests.deploy.dockerfile import copy_sources, parse
from tests.deploy.tools import REPO


def _run(cmd: list[str], cwd: str | None = None) -> str:
    # Nothing from the checkout may leak into the clean venv through the caller's environment.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=cwd, env=env)
    assert r.returncode == 0, f"{' '.join(cmd)}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r.stdout


def _constraints() -> dict[str, str]:
    out = {}
    for line in (REPO / "deploy" / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            out[re.sub(r"[-_.]+", "-", name).lower()] = version.strip()
    return out


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("wheel")
    # The build stage's context: only what its COPY lines name (and .dockerignore lets through).
    ctx = root / "context"
    build = {s.name: s for s in parse()}["build"]
    for src in copy_sources(build):
        dst = ctx / src
        if (REPO / src).is_dir():
            shutil.copytree(REPO / src, dst, ignore=shutil.ignore_patterns("__pycache__", "bench", "dev"))
        else:
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / src, dst)
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--wheel-dir", str(root / "wheels"), str(ctx)])
    wheel = next((root / "wheels").glob("kvgate-*.whl"))
    env = root / "venv"
    _run([sys.executable, "-m", "venv", str(env)])
    _run([str(env / "bin" / "python"), "-m", "pip", "install", "-q", "--only-binary=:all:",
          "--constraint", str(REPO / "deploy" / "constraints.txt"), str(wheel)])
    return env


def test_clean_venv_holds_exactly_the_constraints(venv: Path) -> None:
    frozen = _run([str(venv / "bin" / "python"), "-m", "pip", "freeze", "--exclude", "kvgate"]).splitlines()
    installed = {re.sub(r"[-_.]+", "-", n).lower(): v for n, _, v in (ln.partition("==") for ln in frozen if ln)}
    want = _constraints()
    assert installed == want, (f"missing from deploy/constraints.txt: {sorted(installed.keys() - want.keys())}; "
                               f"pinned but not installed: {sorted(want.keys() - installed.keys())}; "
                               f"differ: {sorted(k for k in installed.keys() & want.keys() if installed[k] != want[k])}"
                               " — run `make lock`")


def test_wheel_holds_runtime_code_only(venv: Path) -> None:
    code = ("import importlib.util as u; "
            "print(*[m for m in ('kvgate.assembly', 'kvgate.sim.server', 'kvgate.bench', 'kvgate.dev') "
            "if u.find_spec(m)])")
    assert _run([str(venv / "bin" / "python"), "-c", code], cwd="/").split() == ["kvgate.assembly",
                                                                                 "kvgate.sim.server"]


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for p in started:
        p.kill()
        p.wait(timeout=10)


def _wait(url: str, p: subprocess.Popen[bytes], log: Path, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert p.poll() is None, f"exited {p.returncode}:\n{log.read_text()[-3000:]}"
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"{url} not ready:\n{log.read_text()[-3000:]}")


def test_serve_from_the_wheel_answers_through_a_simulated_worker(venv: Path, tmp_path: Path,
                                                                  procs: list[subprocess.Popen[bytes]]) -> None:
    bin_ = venv / "bin"
    # A clean environment: no PYTHONPATH, no KVGATE_* from the caller, a scratch cache for the tiny model.
    env = {"PATH": f"{bin_}:/usr/bin:/bin", "HOME": str(tmp_path), "KVGATE_CACHE_DIR": str(tmp_path / "cache")}
    sim_port, gw_port, events = free_port(), free_port(), free_port()

    def spawn(name: str, *args: str) -> tuple[subprocess.Popen[bytes], Path]:
        log = tmp_path / f"{name}.log"
        with open(log, "wb") as f:
            p = subprocess.Popen([str(bin_ / "kvgate"), *args], cwd=tmp_path, env=env, stdout=f,
                                 stderr=subprocess.STDOUT)
        procs.append(p)
        return p, log

    sim, sim_log = spawn("sim", "sim", "--port", str(sim_port), "--block-size", "16",
                         "--kv-events", f"tcp://127.0.0.1:{events}")
    _wait(f"http://127.0.0.1:{sim_port}/health", sim, sim_log)
    gw, gw_log = spawn("serve", "serve", "--port", str(gw_port),
                       "--worker", f"http://127.0.0.1:{sim_port}=kvgate-tiny@sim")
    _wait(f"http://127.0.0.1:{gw_port}/ready", gw, gw_log)
    r = httpx.post(f"http://127.0.0.1:{gw_port}/v1/chat/completions", timeout=30,
                   headers={"x-conversation-id": "wheel-test"},
                   json={"model": "kvgate-tiny", "messages": [{"role": "user", "content": "hello"}]})
    assert r.status_code == 200, r.text
    assert r.headers["x-kvgate-worker"] == f"127.0.0.1:{sim_port}"
    assert r.json()["choices"][0]["message"]["content"]
    assert os.path.isdir(tmp_path / "cache"), "the simulator built its tiny model where KVGATE_CACHE_DIR says"
