"""The package layering (docs/architecture.md): no import cycle between kvgate's packages, the pure cores
import no adapter, the configuration no front. Every import counts, TYPE_CHECKING ones too: a cycle of
annotations is still one concept that cannot be understood without the other."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "kvgate"
TOOLS = {"bench", "dev"}
"""Benchmarks and dev tooling: not runtime code, may import anything."""


def room(module: str) -> str:
    """A module's package under kvgate (``kvgate.gateway.relay`` → ``gateway``; the generated protobuf code
    is a room of its own, below everything)."""
    parts = module.split(".")
    if parts[1:3] == ["grpc", "gen"]:
        return "grpc.gen"
    return parts[1] if len(parts) > 1 else parts[0]


def graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = defaultdict(set)
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        mod = ".".join(rel.parts)
        if room(mod) == "grpc.gen":
            continue
        src = room(mod) if path.parent != ROOT else path.stem
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for n in names:
                if n.startswith("kvgate.") and room(n) != src:
                    edges[src].add(room(n))
    return edges


def cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(edges.get(n, ())):
            if state.get(m) == 1:
                return [*stack[stack.index(m):], m]
            if m not in state and (found := visit(m)) is not None:
                return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(edges):
        if n not in state and (found := visit(n)) is not None:
            return found
    return None


def test_no_import_cycle_between_packages() -> None:
    edges = {k: v - TOOLS for k, v in graph().items() if k not in TOOLS}
    assert cycle(edges) is None, " -> ".join(cycle(edges) or [])


def reach(edges: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for m in edges.get(todo.pop(), ()):
            if m not in seen:
                seen.add(m)
                todo.append(m)
    return seen


FRONTS = {"gateway", "grpc", "epp", "fronts", "assembly", "cli", "demo", "serving", "connections"}
ADAPTERS = FRONTS | {"kvstore", "discovery", "admission", "sim", "tune"}


def test_the_pure_cores_import_no_adapter() -> None:
    edges = graph()
    for core in ("router", "session", "history", "sequences", "clock", "errors", "safejson"):
        assert not reach(edges, core) & ADAPTERS, (core, sorted(reach(edges, core) & ADAPTERS))


def test_the_configuration_imports_no_front() -> None:
    assert not reach(graph(), "config") & FRONTS, sorted(reach(graph(), "config") & FRONTS)
