"""The Dockerfile: hadolint clean, and the properties the images must have, read from the file.

No image is built here (no Docker daemon): what a build would do is proven piecewise — the wheel the
build stage makes and the exact install the runtime stage runs are exercised by test_wheel.py from the
same build context; the engines target's pip line is the one kvgate/dev/engines.py runs for the engine
suite. What only a real build can show: the base image's own contents, and the engines target's
download of CPU torch from PyTorch's index.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.deploy.dockerfile import copy_sources, dockerignore_allows, exec_form, parse
from tests.deploy.tools import REPO, hadolint


def test_hadolint_is_clean() -> None:
    r = subprocess.run([hadolint(), "--no-color", "--failure-threshold", "style", str(REPO / "Dockerfile")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout == "", r.stdout + r.stderr


def test_hadolint_flags_what_the_dockerfile_avoids(tmp_path: Path) -> None:
    # The linter runs and can fail: the habits the real file avoids are flagged.
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install requests\nUSER root\nCMD python -m http.server\n")
    r = subprocess.run([hadolint(), "--no-color", str(bad)], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    for rule in ("DL3007", "DL3013", "DL3042", "DL3002", "DL3025"):
        assert rule in r.stdout, r.stdout


def test_final_targets_run_one_process_as_a_non_root_user_with_healthcheck() -> None:
    stages = {s.name: s for s in parse()}
    assert parse()[-1].name == "gateway", "`docker build .` must give the gateway"
    want = {"gateway": ["kvgate", "serve"], "sim": ["kvgate", "sim"]}
    for name, entry in want.items():
        chain, s = [], stages[name]
        while True:  # a stage inherits USER, STOPSIGNAL and HEALTHCHECK from the stage it is built FROM
            chain.append(s)
            if s.base not in stages:
                break
            s = stages[s.base]

        def inherited(op: str, chain: list = chain) -> str | None:
            return next((v for st in chain if (v := st.last(op)) is not None), None)

        assert exec_form(inherited("ENTRYPOINT") or "") == entry
        user = inherited("USER") or "root"
        assert user.split(":")[0] not in ("root", "0"), f"{name} runs as {user}"
        assert inherited("STOPSIGNAL") == "SIGTERM"
        health = inherited("HEALTHCHECK") or ""
        assert "/health" in health and "CMD" in health, health
        assert chain[-1].base.startswith("${PYTHON_IMAGE}")


def test_base_is_slim_python_311_and_no_stage_installs_a_compiler() -> None:
    text = (REPO / "Dockerfile").read_text()
    assert "ARG PYTHON_IMAGE=python:3.11-slim" in text
    for s in parse():
        for run in s.all("RUN"):
            for compiler in ("gcc", "g++", "build-essential", "clang"):
                assert f" {compiler}" not in run, f"{s.name} installs {compiler}"


def test_runtime_installs_exactly_the_constraints_from_wheels() -> None:
    runtime = {s.name: s for s in parse()}["runtime"]
    assert "deploy/constraints.txt /tmp/constraints.txt" in runtime.all("COPY")
    install = next(r for r in runtime.all("RUN") if "pip install" in r)
    # The same flags tests/deploy/test_wheel.py installs with.
    assert "--only-binary=:all: --constraint /tmp/constraints.txt /tmp/wheels/*.whl" in install


def test_every_copy_source_is_in_the_build_context() -> None:
    for s in parse():
        for src in copy_sources(s):
            assert (REPO / src).exists(), f"{s.name}: COPY {src}: no such path"
            assert dockerignore_allows(src), f"{s.name}: COPY {src} is excluded by .dockerignore"
    # ... and what should stay out does.
    for out in (".git", ".venv", "tests", "data", "kvgate/bench", "kvgate/dev", "deploy/helm"):
        assert not dockerignore_allows(out), out


@pytest.mark.parametrize("src", ["pyproject.toml", "README.md", "kvgate/assembly.py", "deploy/constraints.txt"])
def test_dockerignore_lets_the_build_inputs_through(src: str) -> None:
    assert dockerignore_allows(src)
