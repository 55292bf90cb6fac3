"""kvgate's estimate of a conversation's LMCache L1 residency."""

from __future__ import annotations

import msgpack

from kvgate.router.residency import Residency


def test_stored_prompt_chunks_are_credited_up_to_the_remote_answer_within_the_ttl() -> None:
    r = Residency().stored("node0", 1300, now=0, ttl_s=100, chunk_tokens=256)
    assert r.cpu_tokens(remote_tokens=1280, now=50, ttl_s=100) == {"node0": 1280}
    assert r.cpu_tokens(remote_tokens=512, now=50, ttl_s=100) == {"node0": 512}  # the prompt diverged after 512
    assert r.cpu_tokens(remote_tokens=0, now=50, ttl_s=100) == {}  # Redis holds nothing: neither does L1
    assert r.cpu_tokens(remote_tokens=1280, now=101, ttl_s=100) == {}  # assumed evicted


def test_prefetch_credits_another_node_and_a_longer_prefix() -> None:
    r = Residency().stored("node0", 600, 0, 100, 256).stored("node1", 2000, 10, 100, 256)
    assert r.cpu_tokens(remote_tokens=4096, now=20, ttl_s=100) == {"node0": 512, "node1": 1792}


def test_expired_entries_are_dropped_when_another_node_is_noted() -> None:
    r = Residency().stored("a", 512, 0, 10, 256).stored("b", 512, 50, 10, 256)
    assert [e[0] for e in r.entries] == ["b"]


def test_hicache_host_tokens_come_from_cpu_pinned_events() -> None:
    from kvgate.router.index import PrefixIndex
    from kvgate.router.kvevents import KvEventState
    from kvgate.router.residency import hicache_host_tokens
    from kvgate.router.types import WorkerId

    state = KvEventState(PrefixIndex())
    a, b = WorkerId("sgl-a"), WorkerId("sgl-b")
    for w in (a, b):
        state.add_worker(w)
    stored = {"type": "BlockStored", "block_hashes": [-3, 4, -5], "parent_block_hash": None, "token_ids": [],
              "block_size": 16, "lora_id": None}
    state.on_message(a, 0, msgpack.packb([0.0, [{**stored, "medium": "CPU_PINNED"}], 0]))
    state.on_message(b, 0, msgpack.packb([0.0, [{**stored, "medium": "GPU"}], 0]))
    got = hicache_host_tokens(state.index, {a: [-3, 4, -5, 9], b: [-3, 4, -5, 9]}, {a: 16, b: 16})
    assert got == {"sgl-a": 48}  # b's pages are on its GPU only
