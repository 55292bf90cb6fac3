"""The generated gRPC code is what the protos say, and the protos document every field.

``kvgate/grpc/gen/`` is checked in (the wheel has no protoc). Regenerating it here with the pinned
grpcio-tools and mypy-protobuf must give the same files, byte for byte: a proto edited without
``python -m kvgate.dev.protos``, or generated code edited by hand, fails.
"""

from __future__ import annotations

from pathlib import Path

from google.protobuf import descriptor_pb2

from kvgate.dev import protos


def test_checked_in_code_equals_a_fresh_generation(tmp_path: Path) -> None:
    fresh = tmp_path / "gen"
    protos.generate(fresh)
    have = {p.relative_to(protos.OUT).as_posix(): p.read_bytes() for p in protos.OUT.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts}
    want = {p.relative_to(fresh).as_posix(): p.read_bytes() for p in fresh.rglob("*") if p.is_file()}
    assert sorted(have) == sorted(want), "files differ: run `python -m kvgate.dev.protos`"
    stale = [name for name in want if have[name] != want[name]]
    assert not stale, f"stale generated files (run `python -m kvgate.dev.protos`): {stale}"


def test_generated_imports_stay_under_kvgate_grpc_gen() -> None:
    for p in (p for p in protos.OUT.rglob("*") if p.suffix in (".py", ".pyi")):
        for line in p.read_text().splitlines():
            words = line.split()
            if len(words) >= 2 and words[0] in ("from", "import"):
                assert words[1].split(".")[0] not in ("envoy", "xds", "udpa", "validate") \
                    and not words[1].startswith("kvgate.v1"), (p, line)


def test_every_kvgate_message_field_and_method_is_documented(tmp_path: Path) -> None:
    out = tmp_path / "set.pb"
    protos.descriptor_set(out)
    fds = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    missing: list[str] = []
    for f in fds.file:
        if not f.name.startswith("kvgate/"):
            continue
        # A location's path names what it documents: [4, i] message i, [4, i, 2, j] its field j,
        # [6, i] service i, [6, i, 2, j] its method j. Fields declared on consecutive lines under one
        # comment are documented together (`double created = 5;` then `double last_activity = 6;`).
        locs = {tuple(loc.path): loc for loc in f.source_code_info.location}
        for i, m in enumerate(f.message_type):
            if not locs[(4, i)].leading_comments.strip():
                missing.append(f"{f.name}: message {m.name}")
            covered = False
            for j, fld in enumerate(m.field):
                loc = locs[(4, i, 2, j)]
                prev = locs.get((4, i, 2, j - 1))
                grouped = prev is not None and prev.span[0] == loc.span[0] - 1
                covered = bool(loc.leading_comments.strip()) or (grouped and covered)
                if not covered:
                    missing.append(f"{f.name}: {m.name}.{fld.name}")
        for i, s in enumerate(f.service):
            if not locs[(6, i)].leading_comments.strip():
                missing.append(f"{f.name}: service {s.name}")
            missing += [f"{f.name}: {s.name}.{meth.name}" for j, meth in enumerate(s.method)
                        if not locs[(6, i, 2, j)].leading_comments.strip()]
    assert not missing, f"undocumented: {missing}"
