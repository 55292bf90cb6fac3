"""What differs between the engines the simulator imitates, below the HTTP layer: the prefix cache, when
a request's KV enters it, how a prompt's pages are named, and how KV events look on the wire.

``EngineCore`` keeps one scheduler for both; an ``EngineKind`` supplies the rest.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import msgpack

from kvgate.router.hashing import BlockHash, BlockHasher, VllmHasher
from kvgate.router.hashing import event_int as vllm_event_int
from kvgate.router.sglang import SglangHasher
from kvgate.router.sglang import event_int as sglang_event_int
from kvgate.sim.blockpool import AllBlocksCleared, BlockPool, BlockRemoved, BlockStored, KVEvent
from kvgate.sim.radixpool import RadixPool

EngineName = Literal["vllm", "sglang"]


class PrefixPool(Protocol):
    """The paged prefix cache ``EngineCore`` drives (``BlockPool``: vLLM; ``RadixPool``: SGLang)."""

    num_blocks: int
    block_size: int

    @property
    def num_free(self) -> int: ...
    def usage(self) -> float: ...
    def longest_hit(self, hashes: Sequence[BlockHash], max_blocks: int) -> list[int]: ...
    def is_free(self, block_id: int) -> bool: ...
    def is_cached(self, h: BlockHash) -> bool: ...
    def cached_hashes(self) -> set[BlockHash]: ...
    def host_hit(self, hashes: Sequence[BlockHash], start: int, max_blocks: int) -> int: ...
    def load_back(self, hashes: Sequence[BlockHash], pages: Sequence[int]) -> float: ...
    def touch(self, block_ids: Iterable[int]) -> None: ...
    def allocate(self, n: int) -> list[int] | None: ...
    def free(self, block_ids: Sequence[int]) -> None: ...
    def cache_blocks(self, block_ids: Sequence[int], hashes: Sequence[BlockHash], parent: BlockHash | None,
                     token_ids: Sequence[int], extra_keys: tuple[object, ...] | None = None) -> list[int]: ...
    def reset(self) -> bool: ...
    def take_events(self) -> list[KVEvent]: ...


@dataclass(frozen=True, slots=True)
class EngineKind:
    name: EngineName
    make_pool: Callable[[int, int], PrefixPool]
    cache_while_decoding: bool
    """vLLM caches a block as soon as it is full, generated tokens included; SGLang inserts a request's
    KV into its radix tree only when a prefill (chunk) completes and when the request finishes."""
    cache_when_scheduled: bool
    """vLLM commits blocks to its prefix cache when it schedules their computation (a request behind
    them hits them at once); SGLang's radix tree takes them after the forward."""
    encode_event: Callable[[KVEvent], dict[str, Any]]
    replay_repeats_topic: bool
    """SGLang's replay replies are ``[topic, seq, payload]`` like live ones; vLLM's omit the topic."""
    event_int: Callable[[bytes], int]
    """A digest as this engine's KV events carry it (vLLM: low 64 bits unsigned; SGLang: first 64 signed)."""
    hasher: Callable[[int, Literal["sha256", "sha256_cbor"], str | None], BlockHasher]
    """(block size, vLLM's hash algorithm, vLLM's seed) -> the page identity; SGLang has neither knob."""


def encode_vllm_event(ev: KVEvent) -> dict[str, Any]:
    if isinstance(ev, BlockStored):
        # Field for field what vLLM 0.32 publishes (captured from a real worker): untagged per-block
        # extra keys, the salt on the chain's first block only.
        first = list(ev.extra_keys) if ev.extra_keys is not None and ev.parent_block_hash is None else None
        return {
            "type": "BlockStored",
            "block_hashes": [vllm_event_int(h) for h in ev.block_hashes],
            "parent_block_hash": vllm_event_int(ev.parent_block_hash) if ev.parent_block_hash else None,
            "token_ids": list(ev.token_ids),
            "block_size": ev.block_size,
            "lora_id": None,
            "medium": ev.medium,
            "lora_name": None,
            "extra_keys": [first] + [None] * (len(ev.block_hashes) - 1),
            "group_idx": 0,
            "kv_cache_spec_kind": "full_attention",
        }
    if isinstance(ev, BlockRemoved):
        return {"type": "BlockRemoved", "block_hashes": [vllm_event_int(h) for h in ev.block_hashes],
                "medium": ev.medium, "group_idx": 0}
    assert isinstance(ev, AllBlocksCleared)
    return {"type": "AllBlocksCleared"}


def encode_sglang_event(ev: KVEvent) -> dict[str, Any]:
    """SGLang 0.5.23's msgspec structs (``tag=True, omit_defaults=True``): required fields always, the
    optional ones (``cache_salt``, ``session_id``, ``lora_name``) only when set; ids signed int64."""
    if isinstance(ev, BlockStored):
        out: dict[str, Any] = {
            "type": "BlockStored",
            "block_hashes": [sglang_event_int(h) for h in ev.block_hashes],
            "parent_block_hash": sglang_event_int(ev.parent_block_hash) if ev.parent_block_hash else None,
            "token_ids": list(ev.token_ids),
            "block_size": ev.block_size,
            "lora_id": None,
            "medium": ev.medium,
        }
        if ev.extra_keys:
            out["cache_salt"] = ev.extra_keys[0]
        return out
    if isinstance(ev, BlockRemoved):
        return {"type": "BlockRemoved", "block_hashes": [sglang_event_int(h) for h in ev.block_hashes],
                "medium": ev.medium}
    assert isinstance(ev, AllBlocksCleared)
    return {"type": "AllBlocksCleared"}


def encode_batch(kind: EngineKind, events: list[KVEvent], ts: float) -> bytes:
    # Both engines: [ts, [event, ...], data-parallel rank].
    packed: bytes = msgpack.packb([ts, [kind.encode_event(e) for e in events], 0], use_bin_type=True)
    return packed


def _vllm_hasher(block_size: int, algo: Literal["sha256", "sha256_cbor"], seed: str | None) -> BlockHasher:
    return VllmHasher(block_size, algo, seed)


def _sglang_hasher(block_size: int, algo: Literal["sha256", "sha256_cbor"], seed: str | None) -> BlockHasher:
    return SglangHasher(block_size)


VLLM = EngineKind("vllm", BlockPool, True, True, encode_vllm_event, False, vllm_event_int, _vllm_hasher)
SGLANG = EngineKind("sglang", RadixPool, False, False, encode_sglang_event, True, sglang_event_int, _sglang_hasher)
KINDS: dict[str, EngineKind] = {k.name: k for k in (VLLM, SGLANG)}


def make_hasher(kind: EngineKind, block_size: int, algo: Literal["sha256", "sha256_cbor"] = "sha256",
                seed: str | None = None) -> BlockHasher:
    """The page identity of one worker of this kind (vLLM's algorithm and seed do not apply to SGLang)."""
    return kind.hasher(block_size, algo, seed)
