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


def test_resync_drops_the_workers_entries_and_a_partial_buffer_rebuilds_a_safe_subset() -> None:
    s = state()
    s.on_message(W, 0, batch(stored(1, 2)))
    assert s.resync(W) == 0 and s.stale(W) and s.index.block_count(W) == 0
    # The publisher's buffer only reaches back to seq 5: blocks stored before are unknown, and the removal
    # of one of them is ignored; what the replay leaves is held by the worker.
    s.on_replayed(W, [(5, batch(stored(7, 8))), (6, batch(removed(1))), (7, batch(stored(9)))])
    assert not s.stale(W) and s.index.match([7, 8]) == {W: 2} and s.index.match([9]) == {W: 1}
    assert s.stats.replays_failed == 0 and s.stats.resyncs == 1


def test_live_copies_of_replayed_batches_are_skipped_not_taken_for_a_restart() -> None:
    s = state()
    s.resync(W)
    s.on_replayed(W, [(0, batch(stored(1))), (1, batch(stored(2))), (2, batch(removed(2)))])
    # Published while the replay was answered: already in the SUB queue, read after it.
    assert s.on_message(W, 1, batch(stored(2))) is None and s.on_message(W, 2, batch(removed(2))) is None
    assert s.stats.duplicates == 2 and s.stats.restarts == 0 and s.index.match([1, 2]) == {W: 1}
    s.on_message(W, 3, batch(stored(3)))
    # A lower seq with another payload is a new publisher, not a copy.
    s.on_message(W, 0, batch(stored(4)))
    assert s.stats.restarts == 1 and s.index.match([1]) == {} and s.index.match([4]) == {W: 1}


def test_late_join_with_a_partial_buffer_keeps_what_the_buffer_holds() -> None:
    s = state()
    assert s.on_message(W, 8, batch(stored(8))) == 0
    s.on_replayed(W, [(5, batch(stored(5))), (6, batch(stored(6))), (7, batch()), (8, batch(stored(8)))])
    assert s.index.match([5, 6]) == {W: 2} and s.index.match([8]) == {W: 1} and s.stats.replays_failed == 0


def test_a_dropped_connection_makes_the_worker_stale_until_resynced() -> None:
    s = state()
    s.on_message(W, 0, batch(stored(1)))
    s.mark_stale(W)
    assert s.stale(W) and s.index.match([1]) == {W: 1}  # kept, but PrefixKnowledge matches it as nothing
    s.resync(W)
    s.on_replayed(W, [])  # a new publisher with nothing buffered yet
    assert not s.stale(W) and s.index.block_count(W) == 0
    assert s.on_message(W, 0, batch(stored(3))) is None and s.index.match([3]) == {W: 1}


def test_decodes_sglang_events() -> None:
    # SGLang 0.5.23: signed int64 ids (negative ones included), its host tier named CPU_PINNED, the
    # tiers kvgate does not track (DISK, EXTERNAL) skipped, cache_salt riding along.
    sg_stored = {"type": "BlockStored", "block_hashes": [-5, 9], "parent_block_hash": -2**63,
                 "token_ids": [1, 2], "block_size": 1, "lora_id": None, "medium": "CPU_PINNED",
                 "cache_salt": "s"}
    evs = decode_batch(batch(sg_stored, {"type": "BlockRemoved", "block_hashes": [-5], "medium": "DISK"},
                             {"type": "BlockRemoved", "block_hashes": [9], "medium": "GPU"}))
    assert evs == [Stored((-5, 9), -2**63, "CPU"), Removed((9,), "GPU")]
