import msgpack

from kvgate.router.index import PrefixIndex
from kvgate.router.kvevents import BadEvent, Cleared, KvEventState, Removed, Stored, decode_batch
from kvgate.router.types import WorkerId

W = WorkerId("w")


def batch(*events: object) -> bytes:
    return msgpack.packb([1.0, list(events), 0])


def stored(*hs: int, medium: str | None = "GPU", parent: int | None = None) -> dict[str, object]:
    return {"type": "BlockStored", "block_hashes": list(hs), "parent_block_hash": parent, "token_ids": [],
            "block_size": 16, "medium": medium}


def removed(*hs: int) -> dict[str, object]:
    return {"type": "BlockRemoved", "block_hashes": list(hs), "medium": "GPU"}


def test_decodes_maps_arrays_and_raw_digests() -> None:
    raw_digest = b"\x00" * 24 + (5).to_bytes(8, "big")
    evs = decode_batch(batch(stored(1, 2, parent=7), removed(2), {"type": "AllBlocksCleared"},
                             ["BlockStored", [3], None, [], 16, None, "CPU"], stored(raw_digest)))
    assert evs == [Stored((1, 2), 7, "GPU"), Removed((2,), "GPU"), Cleared(), Stored((3,), None, "CPU"),
                   Stored((5,), None, "GPU")]


def test_bad_payloads_are_errors() -> None:
    for bad in (b"\xc1", msgpack.packb({"a": 1}), batch({"type": "Nope"}), batch(stored())):
        try:
            decode_batch(bad)
        except BadEvent:
            continue
        raise AssertionError(f"accepted {bad!r}")


def state() -> KvEventState:
    s = KvEventState(PrefixIndex())
    s.add_worker(W)
    return s


def test_in_order_batches_apply() -> None:
    s = state()
    assert s.on_message(W, 0, batch(stored(1, 2, 3))) is None
    assert s.on_message(W, 1, batch(removed(3))) is None
    assert s.index.match([1, 2, 3]) == {W: 2}
    assert s.stats.applied == 2


def test_gap_asks_for_replay_and_replay_fills_it_in_order() -> None:
    s = state()
    s.on_message(W, 0, batch(stored(1)))
    # Seqs 1 and 2 were lost; 3 removes a block that 2 stored: order matters.
    assert s.on_message(W, 3, batch(removed(3), stored(4))) == 1
    s.on_replayed(W, [(1, batch(stored(2))), (2, batch(stored(3)))])
    assert s.index.match([1, 2, 3]) == {W: 2} and s.index.match([4]) == {W: 1}
    assert s.stats.gaps == 1


def test_failed_replay_drops_the_workers_entries() -> None:
    s = state()
    s.on_message(W, 0, batch(stored(1, 2)))
    s.on_message(W, 5, batch(stored(9)))
    s.on_replay_failed(W)
    assert s.index.match([1]) == {} and s.index.match([9]) == {W: 1} and s.stats.replays_failed == 1


def test_publisher_restart_clears_then_applies() -> None:
    s = state()
    s.on_message(W, 0, batch(stored(1)))
    s.on_message(W, 1, batch(stored(2)))
    assert s.on_message(W, 0, batch(stored(7))) is None
    assert s.index.match([1]) == {} and s.index.match([7]) == {W: 1}
    assert s.stats.restarts == 1


def test_malformed_and_unknown_are_counted_not_fatal() -> None:
    s = state()
    s.on_message(W, 0, b"garbage")
    s.on_message(WorkerId("ghost"), 0, batch(stored(1)))
    s.on_message(W, 1, batch(removed(42)))
    assert s.stats.malformed == 1 and s.stats.unknown_worker == 1 and s.stats.unknown_removals == 1
    assert s.index.block_count() == 0


def test_late_join_replays_from_zero() -> None:
    s = state()
    assert s.on_message(W, 4, batch(stored(5))) == 0
    s.on_replayed(W, [(0, batch(stored(1))), (1, batch(stored(2))), (2, batch()), (3, batch()),
                      (4, batch(stored(5)))])
    assert s.index.match([1, 2]) == {W: 2} and s.index.match([5]) == {W: 1} and s.stats.replays_failed == 0


def test_partial_replay_counts_as_failed() -> None:
    s = state()
    s.on_message(W, 0, batch(stored(1, 2, 3)))
    assert s.on_message(W, 5, batch(stored(9))) == 1
    s.on_replayed(W, [(4, batch(removed(3)))])  # seqs 1-3 no longer in the publisher's buffer
    assert s.stats.replays_failed == 1 and s.index.match([1]) == {} and s.index.match([9]) == {W: 1}
