"""Generate ``kvgate/grpc/gen/`` from ``proto/``: ``python -m kvgate.dev.protos`` (a source checkout with the
dev extras: grpcio-tools and mypy-protobuf, pinned in pyproject.toml).

The generated modules are checked in (the wheel has no protoc); ``tests/test_grpc_gen.py`` regenerates
them into a temporary directory and fails when anything differs, so a changed ``.proto`` without a
regeneration (or a hand edit of generated code) cannot land.

protoc names Python modules after proto paths (``envoy/config/core/v3/base.proto`` ->
``envoy.config.core.v3.base_pb2``). Top-level ``envoy``, ``xds``, ``udpa``, ``validate`` and ``kvgate.v1``
packages would clash with other distributions (and ``kvgate.v1`` with kvgate itself), so every import
of a generated module is rewritten under ``kvgate.grpc.gen``. Only Python module paths move: proto
file names, packages and gRPC method paths are unchanged, so the wire and reflection see the originals.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PROTO = REPO / "proto"
THIRD_PARTY = ("envoy-api", "xds", "protoc-gen-validate")
OUT = REPO / "kvgate" / "grpc" / "gen"
PREFIX = "kvgate.grpc.gen"
TOP = ("envoy", "xds", "udpa", "validate", "kvgate")
ROOTS = ["kvgate/v1/routing.proto", "kvgate/v1/conversations.proto", "kvgate/v1/policy.proto",
         "kvgate/v1/fleet.proto", "envoy/service/ext_proc/v3/external_processor.proto"]

_IMPORT = re.compile(rf"^(\s*)(from|import) ({'|'.join(TOP)})(\.| )", re.M)


def include_dirs() -> list[Path]:
    import grpc_tools

    return [PROTO, *(PROTO / "third_party" / t for t in THIRD_PARTY), Path(grpc_tools.__file__).parent / "_proto"]


def sources() -> list[str]:
    """The root protos and every vendored proto they import (the whole closure is generated)."""
    files = set(ROOTS)
    for t in THIRD_PARTY:
        base = PROTO / "third_party" / t
        files |= {p.relative_to(base).as_posix() for p in base.rglob("*.proto")}
    return sorted(files)


def _protoc(args: list[str]) -> None:
    bindir = Path(sys.executable).parent
    cmd = [sys.executable, "-m", "grpc_tools.protoc", *(f"-I{d}" for d in include_dirs()),
           f"--plugin=protoc-gen-mypy={bindir / 'protoc-gen-mypy'}",
           f"--plugin=protoc-gen-mypy_grpc={bindir / 'protoc-gen-mypy_grpc'}", *args]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    if r.returncode != 0:
        raise RuntimeError(f"protoc failed:\n{r.stderr}")


def _rewrite(text: str) -> str:
    return _IMPORT.sub(lambda m: f"{m.group(1)}{m.group(2)} {PREFIX}.{m.group(3)}{m.group(4)}", text)


def generate(out: Path) -> None:
    """Generate every module into ``out`` (replaced), imports rewritten, packages made."""
    with tempfile.TemporaryDirectory() as tmp:
        _protoc([f"--python_out={tmp}", f"--grpc_python_out={tmp}", f"--mypy_out={tmp}", f"--mypy_grpc_out={tmp}",
                 *sources()])
        if out.exists():
            shutil.rmtree(out)
        for src in sorted(Path(tmp).rglob("*")):
            if src.is_file():
                dst = out / src.relative_to(tmp)
                dst.parent.mkdir(parents=True, exist_ok=True)
                dst.write_text(_rewrite(src.read_text()))
    for d in [out, *(p for p in out.rglob("*") if p.is_dir())]:
        init = d / "__init__.py"
        if not init.exists():
            init.write_text("" if d != out else '"""Generated from proto/ by kvgate/dev/protos.py: do not edit."""\n')


def descriptor_set(path: Path) -> None:
    """A FileDescriptorSet of the roots with comments (source info), for documentation checks."""
    _protoc([f"--descriptor_set_out={path}", "--include_source_info", "--include_imports", *ROOTS])


if __name__ == "__main__":
    generate(OUT)
    print(f"generated {sum(1 for _ in OUT.rglob('*.py*'))} files in {OUT.relative_to(REPO)}")
