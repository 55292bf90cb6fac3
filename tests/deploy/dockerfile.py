"""A small reader for the repository's Dockerfile and .dockerignore: enough to check what the tests
need (stages, instructions, COPY sources), not a general parser."""

from __future__ import annotations

import fnmatch
import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from tests.deploy.tools import REPO


@dataclass
class Stage:
    name: str
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, op: str) -> list[str]:
        return [arg for o, arg in self.instructions if o == op]

    def last(self, op: str) -> str | None:
        found = self.all(op)
        return found[-1] if found else None


def parse(path: Path = REPO / "Dockerfile") -> list[Stage]:
    lines: list[str] = []
    pending = ""
    for raw in path.read_text().splitlines():
        if raw.lstrip().startswith("#"):
            continue
        if raw.rstrip().endswith("\\"):
            pending += raw.rstrip()[:-1] + " "
            continue
        line = (pending + raw).strip()
        pending = ""
        if line:
            lines.append(line)
    stages: list[Stage] = []
    for line in lines:
        op, _, arg = line.partition(" ")
        op = op.upper()
        if op == "FROM":
            words = arg.split()
            name = words[2] if len(words) >= 3 and words[1].upper() == "AS" else str(len(stages))
            stages.append(Stage(name, words[0]))
        elif stages:
            stages[-1].instructions.append((op, arg.strip()))
    return stages


def exec_form(arg: str) -> list[str]:
    """An instruction's argument in exec (JSON) form, else its shell words."""
    try:
        value = json.loads(arg)
    except ValueError:
        return shlex.split(arg)
    return [str(v) for v in value] if isinstance(value, list) else [str(value)]


def copy_sources(stage: Stage) -> list[str]:
    """The build-context paths a stage's COPY instructions read (not those copied from other stages)."""
    out = []
    for arg in stage.all("COPY"):
        words = arg.split()
        if any(w.startswith("--from=") for w in words):
            continue
        srcs = [w for w in words if not w.startswith("--")][:-1]
        out += srcs
    return out


def dockerignore_allows(path: str, ignore: Path = REPO / ".dockerignore") -> bool:
    """Docker's rule: the last pattern that matches a path (or one of its parents) decides; ``!`` lets
    it back in. Patterns here are plain names and globs, as in the repository's own file."""
    patterns = [p.strip() for p in ignore.read_text().splitlines() if p.strip() and not p.startswith("#")]
    parts = Path(path).parts
    allowed = True
    for pat in patterns:
        negate = pat.startswith("!")
        pat = pat.lstrip("!").rstrip("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        if any(fnmatch.fnmatchcase(p, pat) or (pat.startswith("**/") and fnmatch.fnmatchcase(p, pat[3:]))
               for p in prefixes):
            allowed = negate
    return allowed
