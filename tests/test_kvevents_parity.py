"""The fast KV event path (``decode_runs``, runs applied in bulk) against the reference (``decode_batch``,
one index operation per event): the same outcome on random event streams and on hostile payloads, which
are dropped and counted, never raised out of the stream."""

from __future__ import annotations

import random
from typing import Any

import msgpack
import pytest

from kvgate.router import kvevents
from kvgate.router.index import TIERS, PrefixIndex
from kvgate.router.kvevents import BadEvent, KvEventState, Run, decode_batch, decode_runs, runs_of
from kvgate.router.types import WorkerId

W = WorkerId("w")
UNIVERSE = range(40)
"""Block hashes drawn from few values, so removals and repeated stores hit blocks that are held."""


def reference(payload: bytes) -> list[Run] | str:
    try:
        return runs_of(decode_batch(payload))
    except BadEvent:
        return "bad"


def fast(payload: bytes) -> list[Run] | str:
    try:
        return decode_runs(payload)
    except BadEvent:
        return "bad"


# -- generated payloads ---------------------------------------------------------------------------------

def _pick(rng: random.Random, usual: list[Any], odd: list[Any], one_in: int = 12) -> Any:
    """Mostly what engines send, sometimes not: a batch of 8 events is whole about half the time."""
    return rng.choice(odd if rng.randrange(one_in) == 0 else usual)


def _hashes(rng: random.Random) -> Any:
    if rng.randrange(12) == 0:
        return rng.choice([None, 3, [], "x"])
    odd = [-5, -2**63, 2**64 - 1, True, 1.0, b"\x00" * 31 + b"\x07", "h"]
    return [_pick(rng, list(UNIVERSE), odd, 40) for _ in range(rng.randint(1, 6))]


def _event(rng: random.Random) -> Any:
    kind = _pick(rng, ["BlockStored", "BlockStored", "BlockRemoved", "AllBlocksCleared"], ["Nope", None, 3])
    medium = _pick(rng, [None, "GPU", "GPU", "GPU", "CPU", "CPU_PINNED"], ["DISK", 5, b"GPU", "\udcff"])
    fields: dict[Any, Any] = {"type": kind, "block_hashes": _hashes(rng), "medium": medium}
    if kind == "BlockStored":
        fields |= {"parent_block_hash": _pick(rng, [None, 7, -1], [True, b"\x01", "p"]),
                   "token_ids": list(range(rng.randrange(33))), "block_size": 16, "lora_id": None,
                   "lora_name": None, "extra_keys": [None], "group_idx": 0, "kv_cache_spec_kind": "full_attention"}
    if rng.randrange(12) == 0:
        for key in rng.sample(["type", "block_hashes", "medium", "parent_block_hash"], rng.randint(1, 2)):
            fields.pop(key, None)
    if rng.randrange(20) == 0:
        fields[rng.choice([7, 1.5, b"k"])] = 1  # a key msgspec will not read as a field name
    if rng.randrange(20) == 0:  # the array-encoded (pre-0.26) form
        return [kind, fields.get("block_hashes"), fields.get("parent_block_hash"), [], 16, None, fields.get("medium")]
    return fields


def _garble(rng: random.Random, raw: bytes) -> bytes:
    pos = rng.randrange(max(1, len(raw)))
    cut = _pick(rng, ["none"], ["truncate", "flip", "insert", "trail"], 5)
    if cut == "truncate":
        return raw[:pos]
    if cut == "flip" and raw:
        return raw[:pos] + bytes([raw[pos] ^ rng.randint(1, 255)]) + raw[pos + 1:]
    if cut == "insert":
        return raw[:pos] + rng.randbytes(rng.randint(1, 3)) + raw[pos:]
    return raw + b"\x00" if cut == "trail" else raw


def payload(rng: random.Random) -> bytes:
    """A batch as an engine would send it, more or less: wrong types, missing fields, garbled bytes."""
    events = [_event(rng) for _ in range(rng.randrange(9))]
    ts = _pick(rng, [1.5, 2], ["t", None, float("nan")])
    shape = _pick(rng, ["batch"], ["short", "long", "map", "events not a list"], 6)
    obj: Any = {"batch": [ts, events, 0], "short": [ts], "long": [ts, events, 0, "extra"], "map": {"a": events},
                "events not a list": [ts, {"e": 1}, 0]}[shape]
    raw: bytes = msgpack.packb(obj, use_bin_type=True, unicode_errors="surrogatepass")
    return _garble(rng, raw)


def P(obj: Any) -> bytes:
    packed: bytes = msgpack.packb(obj)
    return packed


def _map(*pairs: bytes) -> bytes:
    return bytes([0x80 | (len(pairs) // 2)]) + b"".join(pairs)


def _batch(*events: bytes) -> bytes:
    return b"\x92" + P(1.0) + bytes([0x90 | len(events)]) + b"".join(events)


STORED = (P("type"), P("BlockStored"), P("block_hashes"), P([1, 2]))
HOSTILE = [
    b"", b"\xc1", b"\xff" * 9, P({"a": 1}), P([1.0]), P([1.0, [{"type": "Nope"}]]) + b"\x00",
    _batch(_map(*STORED, P("lora_name"), b"\xa2\xff\xfe")),  # bad UTF-8 in a field kvgate does not read
    _batch(_map(*STORED, P("medium"), b"\xa3\xff\xfeG")),  # ... and in one it reads
    _batch(_map(*STORED, P({"k": 1}), P(1))),  # a map keyed by a map (msgpack: TypeError)
    _batch(_map(*STORED, P([1, 2]), P(1))),  # keyed by an array
    _batch(_map(*STORED, P("block_hashes"), P([3]))),  # a key twice: the last wins
    _batch(_map(P("type"), P("BlockStored"), P("type"), P("BlockRemoved"), P("block_hashes"), P([3]))),
    _batch(_map(*STORED, P("x"), b"\x91" * 5000 + b"\x00")),  # deeper than either decoder goes
    _batch(_map(*STORED[:2], P("block_hashes"), b"\xdd\xff\xff\xff\xff")),  # claims 4G hashes, has none
    _batch(_map(*STORED, P("medium"), P(msgpack.ExtType(3, b"x")))),
    b"\x92\xd6\xff\x00\x00\x00\x01" + P([{"type": "BlockStored", "block_hashes": [1]}]),  # a msgpack timestamp
]


def test_generated_payloads_reach_every_branch() -> None:
    # The fuzz below is only as good as its mix: engines' batches (the fast path), batches the fast
    # decoder leaves to the reference, and errors.
    pytest.importorskip("msgspec")
    outcomes = {"fast": 0, "reference": 0, "bad": 0}
    for seed in range(300):
        p = payload(random.Random(seed))
        try:
            kvevents._DECODER.decode(p)
            outcomes["fast"] += 1
        except Exception:
            outcomes["bad" if reference(p) == "bad" else "reference"] += 1
    assert min(outcomes.values()) >= 30, outcomes


@pytest.mark.parametrize("seed", range(40))
def test_fast_decode_matches_reference(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(50):
        p = payload(rng)
        assert fast(p) == reference(p), p


@pytest.mark.parametrize("p", HOSTILE, ids=range(len(HOSTILE)))
def test_hostile_payloads_decode_alike(p: bytes) -> None:
    assert fast(p) == reference(p)


def test_without_msgspec_the_reference_decodes(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(3)
    stream = HOSTILE + [P([1.0, [{"type": "BlockStored", "block_hashes": [rng.randrange(40)], "medium": "GPU"}]])
                        for _ in range(5)]
    want = [fast(p) for p in stream]
    monkeypatch.setattr(kvevents, "_HAVE_MSGSPEC", False)
    assert [fast(p) for p in stream] == want


def test_runs_merge_consecutive_events_of_one_kind_and_tier() -> None:
    p = P([1.0, [{"type": "BlockStored", "block_hashes": [1, 2]}, {"type": "BlockStored", "block_hashes": [3]},
                 {"type": "BlockStored", "block_hashes": [4], "medium": "CPU"},
                 {"type": "BlockStored", "block_hashes": [9], "medium": "DISK"},  # untracked: skipped
                 {"type": "BlockRemoved", "block_hashes": [5], "medium": "CPU_PINNED"},
                 {"type": "AllBlocksCleared"}, {"type": "AllBlocksCleared"},
                 {"type": "BlockStored", "block_hashes": [6]}], 0])
    assert decode_runs(p) == [Run("store", "GPU", (1, 2, 3), 2), Run("store", "CPU", (4,), 1),
                              Run("remove", "CPU", (5,), 1), Run("clear", None, (), 2), Run("store", "GPU", (6,), 1)]
    assert decode_runs(p) == runs_of(decode_batch(p))


# -- applied to the index --------------------------------------------------------------------------------

def _apply(stream: list[bytes], ref: bool) -> tuple[KvEventState, list[int]]:
    seen: list[int] = []
    s = KvEventState(PrefixIndex(), on_stored=lambda w, hs: seen.extend(hs), reference=ref)
    s.add_worker(W)
    for seq, p in enumerate(stream):
        assert s.on_message(W, seq, p) is None  # in order: never a replay
    return s, seen


def _held(index: PrefixIndex) -> dict[str, list[int]]:
    return {t: [h for h in [*UNIVERSE, -5, -2**63, 2**64 - 1, 7] if h in index._held[t].get(W, ())] for t in TIERS}


@pytest.mark.parametrize("seed", range(40))
def test_fast_apply_matches_reference(seed: int) -> None:
    rng = random.Random(1000 + seed)
    stream = [payload(rng) for _ in range(rng.randint(1, 30))]
    (f, f_seen), (r, r_seen) = _apply(stream, False), _apply(stream, True)
    assert f.stats == r.stats
    assert f.stats.malformed + f.stats.batches == len(stream)
    assert _held(f.index) == _held(r.index) and f.index.snapshot() == r.index.snapshot()
    assert f_seen == r_seen


def test_hostile_payloads_are_counted_not_raised() -> None:
    good = P([1.0, [{"type": "BlockStored", "block_hashes": [1, 2], "medium": "GPU"}], 0])
    stream = [good, *HOSTILE, good]
    for ref in (False, True):
        s, _ = _apply(stream, ref)
        assert s.stats.batches + s.stats.malformed == len(stream)
        assert s.stats.malformed >= 8 and s.index.match([1, 2]) == {W: 2}


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_engines_batches_take_the_fast_path(kind: str) -> None:
    # What the simulator sends as each engine (salted chains, the host tier, evictions, a reset): the
    # typed decoder must read every such batch itself, not leave it to the reference.
    pytest.importorskip("msgspec")
    from kvgate.sim.blockpool import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
    from kvgate.sim.kinds import KINDS, encode_batch

    rng = random.Random(5)

    def digest() -> Any:
        return rng.randbytes(32)

    first = BlockStored((digest(), digest()), None, tuple(range(32)), 16, extra_keys=("salt",))
    events: list[KVEvent] = [first, BlockStored((digest(),), first.block_hashes[-1], tuple(range(16)), 16),
                             BlockStored((digest(),), None, tuple(range(16)), 16, medium="CPU_PINNED"),
                             BlockRemoved(first.block_hashes), BlockRemoved((digest(),), medium="CPU"),
                             AllBlocksCleared()]
    for n in range(1, len(events) + 1):
        p = encode_batch(KINDS[kind], events[:n], 12.5)
        kvevents._DECODER.decode(p)
        assert decode_runs(p) == runs_of(decode_batch(p))
