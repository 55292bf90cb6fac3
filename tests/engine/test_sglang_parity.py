"""kvgate's SGLang hasher, event decoding and simulated radix cache against SGLang's own code.

No SGLang engine runs on this machine (no GPU), but its package does: ``sglang_oracle.py`` runs in the
SGLang venv and answers with what SGLang's native page hash, storage hash and real ``RadixCache`` (with
its KV-event recorder and msgspec encoder) produce for the same token sequences.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgpack
import pytest

from kvgate.dev.engines import engines_dir, ensure_sglang
from kvgate.kvstore.hicache_files import HiCacheFileProbe
from kvgate.router.kvevents import Stored, decode_batch
from kvgate.router.sglang import HiCacheFileKeys, SglangHasher
from kvgate.sim.kinds import SGLANG, encode_batch
from kvgate.sim.radixpool import RadixPool

PAGE_SIZES = (1, 16, 64)
NAMESPACES: list[tuple[str | None, str | None]] = [(None, None), (None, "tenant-a"), ("lora-or-key", None),
                                                     ("k", "salt")]


@pytest.fixture(scope="module")
def oracle() -> Any:
    venv = ensure_sglang().venv
    script = Path(__file__).with_name("sglang_oracle.py")

    def ask(request: dict[str, Any]) -> dict[str, Any]:
        env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(engines_dir() / "torch-extensions"),
               "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "SGLANG_DISABLE_REQUEST_LOGGING": "1"}
        r = subprocess.run([str(venv / "bin" / "python"), str(script)], input=json.dumps(request),
                           capture_output=True, text=True, env=env, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        out: dict[str, Any] = json.loads(r.stdout)
        assert out["version"] == "0.5.23"
        return out

    return ask


def _seqs(seed: int, n: int, page: int) -> list[list[int]]:
    rng = random.Random(seed)
    unit = max(page, 16)  # page-1 sequences as long as page-16 ones
    return [[rng.randrange(0, 200_000) for _ in range(rng.randrange(unit, 6 * unit + page // 2 + 2))]
            for _ in range(n)]


def test_page_and_storage_hashes_equal_sglangs(oracle: Any) -> None:
    cases = [{"tokens": t, "page_size": p, "extra_key": ek, "cache_salt": salt}
             for p in PAGE_SIZES for ek, salt in NAMESPACES for t in _seqs(p, 8, p)]
    got = oracle({"hashes": cases})["hashes"]
    pages = 0
    for case, want in zip(cases, got, strict=True):
        toks, p = case["tokens"], case["page_size"]
        full = len(toks) // p
        assert [h.hex() for h in SglangHasher(p).block_hashes(toks)] == want["pages"][:full]
        keys = HiCacheFileKeys("m", p).page_keys(toks, case["extra_key"], case["cache_salt"])
        assert keys == want["storage"][:full]
        pages += full
    assert len(cases) == 96 and pages > 1000


def _trace_ops(page: int, seed: int) -> list[list[Any]]:
    a, b, c, d, e = _seqs(seed, 5, page)
    a = (a * 6)[: 5 * page + page // 2]  # five full pages and, where pages are wider than 1, a partial one
    return [["insert", a, None, None], ["insert", a, None, None],       # the repeat stores nothing
            ["insert", a[: 3 * page] + b, None, None],                  # diverges: the node splits
            ["match", a[: 2 * page] + c, None, None],                   # ends inside a node: split again
            ["insert", a, None, "tenant"], ["insert", d, None, None],   # a salted chain, a new root child
            ["evict", 4 * page], ["match", a, None, None], ["insert", a + e, None, None],
            ["evict", 10**6], ["insert", b, None, "tenant"], ["flush"], ["insert", a, None, None]]


def _replay_on_radix_pool(page: int, ops: list[list[Any]]) -> tuple[list[bytes | None], list[int]]:
    pool, hasher = RadixPool(100_000, page), SglangHasher(page)
    batches: list[bytes | None] = []
    matches = []
    for op in ops:
        if op[0] in ("insert", "match"):
            hashes = hasher.block_hashes(op[1], cache_salt=op[3])
            if op[0] == "match":
                matches.append(len(pool.longest_hit(hashes, len(hashes))) * page)
            else:
                ids = pool.allocate(len(hashes))
                assert ids is not None
                backing = pool.cache_blocks(ids, hashes, None, op[1][: len(hashes) * page],
                                            (op[3],) if op[3] else None)
                pool.free(backing)
        elif op[0] == "evict":
            pool.evict(-(-op[1] // page))
        else:
            assert pool.reset()
        events = pool.take_events()
        batches.append(encode_batch(SGLANG, events, 0.0) if events else None)
    return batches, matches


@pytest.mark.parametrize("page", PAGE_SIZES)
def test_simulated_radix_cache_publishes_sglangs_events(oracle: Any, page: int) -> None:
    ops = _trace_ops(page, 100 + page)
    want = oracle({"traces": [{"page_size": page, "ops": ops}]})["traces"][0]
    got, matches = _replay_on_radix_pool(page, ops)
    assert matches == want["matches"]
    assert [msgpack.unpackb(g)[1:] if g else None for g in got] == \
        [msgpack.unpackb(bytes.fromhex(w))[1:] if w else None for w in want["batches"]]
    # What the gateway decodes from SGLang's own bytes is what the hasher predicts for each stored chain.
    stored = [ev for w in want["batches"] if w for ev in decode_batch(bytes.fromhex(w)) if isinstance(ev, Stored)]
    assert any(ev.parent is not None for ev in stored) and any(min(ev.hashes) < 0 for ev in stored)


def _random_ops(page: int, seed: int, n: int = 80) -> list[list[Any]]:
    """Conversations that grow turn by turn and branch, lookups, evictions of random size, one flush."""
    rng = random.Random(seed)
    convs: list[list[int]] = [[rng.randrange(0, 5000) for _ in range(rng.randrange(1, 4) * page)] for _ in range(4)]
    ops: list[list[Any]] = []
    for i in range(n):
        r = rng.random()
        c = rng.randrange(len(convs))
        if r < 0.5:  # a turn: the conversation grows by a few pages and a ragged tail
            convs[c] = convs[c] + [rng.randrange(0, 5000) for _ in range(rng.randrange(1, 3 * page + 2))]
            ops.append(["insert", convs[c], None, "t" if c == 3 else None])
        elif r < 0.65:  # a branch off an earlier point of the conversation
            cut = rng.randrange(0, len(convs[c]) + 1)
            ops.append(["insert", convs[c][:cut] + [rng.randrange(0, 5000) for _ in range(2 * page)], None, None])
        elif r < 0.85:
            ops.append(["match", convs[c][: rng.randrange(0, len(convs[c]) + 1)], None, "t" if c == 3 else None])
        elif i == n // 2:
            ops.append(["flush"])
        else:
            ops.append(["evict", rng.randrange(1, 6 * page)])
    return ops


@pytest.mark.parametrize("page", PAGE_SIZES)
def test_random_traces_publish_sglangs_events(oracle: Any, page: int) -> None:
    traces = [_random_ops(page, seed) for seed in range(3)]
    wants = oracle({"traces": [{"page_size": page, "ops": ops} for ops in traces]})["traces"]
    for ops, want in zip(traces, wants, strict=True):
        got, matches = _replay_on_radix_pool(page, ops)
        assert matches == want["matches"]
        assert [msgpack.unpackb(g)[1:] if g else None for g in got] == \
            [msgpack.unpackb(bytes.fromhex(w))[1:] if w else None for w in want["batches"]]


async def test_file_backend_probe_reads_sglangs_own_files(oracle: Any, tmp_path: Path) -> None:
    toks = _seqs(11, 1, 16)[0] * 3
    cases = []
    for i, (ek, salt) in enumerate(NAMESPACES):
        d = tmp_path / f"ns{i}"
        cases.append({"dir": str(d), "model_name": "org/tiny-model", "page_size": 16, "tokens": toks,
                      "extra_key": ek, "cache_salt": salt, "write": 3 + i})
    got = oracle({"files": cases})["files"]
    for case, want in zip(cases, got, strict=True):
        assert all(want["written"]) and len(want["written"]) == case["write"]
        keys = HiCacheFileKeys("org/tiny-model", 16)
        assert sorted(keys.file_names(toks, case["extra_key"], case["cache_salt"])[: case["write"]]) == want["files"]
        probe = HiCacheFileProbe(case["dir"], keys, time.monotonic)
        assert await probe.prefix_tokens(toks, case["extra_key"], case["cache_salt"]) == case["write"] * 16
        other = ("x", None) if case["extra_key"] != "x" else (None, None)
        assert await probe.prefix_tokens(toks, *other) == 0  # another namespace shares no file


@pytest.mark.parametrize("dynamo", [False, True])
def test_lora_and_dynamo_namespaced_event_ids(oracle: Any, dynamo: bool) -> None:
    lora_id = "0123456789abcdef0123456789abcdef"  # SGLang appends the adapter's 32-char id to extra_key
    ek = "user-key" + lora_id
    seqs = _seqs(7, 3, 16)
    cases = [(seqs[0], ek, None), (seqs[1], ek, "s"), (seqs[2], "plain-key", None), (seqs[2], None, "s2")]
    ops = [["insert", t, k, s] for t, k, s in cases]
    want = oracle({"traces": [{"page_size": 16, "ops": ops, "dynamo": dynamo,
                               "lora": [[ek, lora_id, "adapter-x"]]}]})["traces"][0]
    hasher = SglangHasher(16, dynamo_format=dynamo)
    for (toks, key, salt), batch in zip(cases, want["batches"], strict=True):
        (ev,) = decode_batch(bytes.fromhex(batch))
        assert isinstance(ev, Stored)
        lora = key if key == ek or dynamo else None
        assert list(ev.hashes) == hasher.event_ints(hasher.block_hashes(toks, cache_salt=salt), cache_salt=salt,
                                                     lora_extra_key=lora)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
