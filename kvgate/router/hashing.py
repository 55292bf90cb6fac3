"""Block hashes exactly as vLLM's v1 prefix cache computes them.

vLLM: ``hash_block_tokens(hash_fn, parent, tokens, extra_keys) = hash_fn((parent or NONE_HASH,
tuple(tokens), extra_keys))``; only full blocks are hashed. ``NONE_HASH = hash_fn(seed)`` where the
seed is ``$PYTHONHASHSEED`` (every worker and kvgate must share it). KV events publish the low 64 bits
of each digest as an unsigned int.

Extra keys are tagged tuples in vLLM 0.32: ``("lora", name, path)`` on every block of a LoRA request,
then ``("cache_salt", salt)`` on the FIRST block only, so a salt namespaces a whole chain; ``None`` when
there are none. (Events publish them untagged: ``["salt"]``; older vLLMs hashed the bare values — the
engine test suite pins the installed version's behaviour.)
"""

from __future__ import annotations

import hashlib
import pickle
import sys
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NewType, Protocol, cast

import blake3
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
HASH_ALGOS: tuple[str, ...] = tuple(_HASH_FNS)


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

    @staticmethod
    def extra_keys(first_block: bool, cache_salt: str | None = None,
                   lora: tuple[str, str] | None = None) -> tuple[Any, ...] | None:
        keys: list[Any] = []
        if lora is not None:
            keys.append(("lora", lora[0], lora[1]))
        if first_block and cache_salt:
            keys.append(("cache_salt", cache_salt))
        return tuple(keys) if keys else None

    def block_hashes(
        self,
        token_ids: Sequence[int],
        *,
        parent: BlockHash | None = None,
        cache_salt: str | None = None,
        lora: tuple[str, str] | None = None,
        start_block: int = 0,
    ) -> list[BlockHash]:
        """Hashes of the full blocks of ``token_ids``; ``lora`` is (name, path).

        ``parent``/``start_block`` continue a chain: pass the last known hash and the index of the
        first block in ``token_ids`` so only new blocks are hashed (incremental per conversation).
        """
        fn = _HASH_FNS[self.algo]
        bs = self.block_size
        prev: bytes = parent if parent is not None else self.none_hash
        out: list[BlockHash] = []
        n_full = len(token_ids) // bs
        for i in range(n_full):
            extra = self.extra_keys(start_block + i == 0, cache_salt, lora)
            prev = fn((prev, tuple(token_ids[i * bs : (i + 1) * bs]), extra))
            out.append(BlockHash(prev))
        return out

    @staticmethod
    def event_ints(hashes: Sequence[bytes], *, cache_salt: str | None = None) -> list[int]:
        return [event_int(h) for h in hashes]


class BlockHasher(Protocol):
    """What the gateway needs of an engine's block hashing (``VllmHasher``; SGLang's has the same shape)."""

    @property
    def block_size(self) -> int: ...

    def block_hashes(self, token_ids: Sequence[int], *, parent: BlockHash | None = None,
                     cache_salt: str | None = None, start_block: int = 0) -> list[BlockHash]: ...

    def event_ints(self, hashes: Sequence[bytes], *, cache_salt: str | None = None) -> list[int]:
        """The ids the engine's KV events carry for these hashes."""
        ...


@dataclass(frozen=True, slots=True)
class HashSpec:
    """One hash identity: workers that share it produce the same block hashes for the same tokens, so a
    prompt is hashed once per distinct spec in its fleet, not once per worker. The cache salt is not
    part of it: it comes with each request."""

    block_size: int
    algo: str = "sha256"
    seed: str | None = None
    family: Literal["vllm", "sglang"] = "vllm"
    """Whose hashing formula: kvgate's simulator hashes exactly as vLLM does, so ``sim`` workers are
    ``vllm`` here and share hashes with real vLLM workers configured alike."""

    @staticmethod
    def for_engine(engine: str, block_size: int, algo: str, seed: str | None) -> HashSpec:
        return HashSpec(block_size, algo, seed, "sglang" if engine == "sglang" else "vllm")


def make_hasher(spec: HashSpec) -> BlockHasher:
    """The hasher for one spec (raises ValueError for an algorithm kvgate cannot compute)."""
    if spec.family == "sglang":
        from kvgate.router.sglang import SglangHasher

        return SglangHasher(spec.block_size)  # SGLang has one formula and no seed
    if spec.algo not in _HASH_FNS:
        raise ValueError(f"unknown hash algo {spec.algo!r}; kvgate computes {sorted(_HASH_FNS)}")
    return VllmHasher(spec.block_size, cast(HashAlgo, spec.algo), spec.seed)


def _u32_be(tokens: Sequence[int]) -> bytes:
    """Tokens as big-endian u32, at C speed (a prompt's keys are computed on the routing path)."""
    arr = array("I", tokens)
    if arr.itemsize != 4:  # pragma: no cover - platforms where C unsigned int is not 32 bits
        return b"".join(t.to_bytes(4, "big") for t in tokens)
    if sys.byteorder == "little":
        arr.byteswap()
    return arr.tobytes()


@dataclass(frozen=True, slots=True)
class LMCacheKeys:
    """The Redis keys LMCache's multiprocess server (0.5.6, blake3, RESP L2 adapter) writes for a token
    sequence, so kvgate can check a conversation's L2 residency with ``EXISTS`` and no LMCache import.

    ``h_0 = blake3(i64_be(0) || u32_be(0))``; ``h_i = blake3(h_{i-1} || u32_be(tokens of chunk i))`` over
    full chunks only; key ``{model_name}@{kv_rank:08x}@{group:x}@{h_i.hex()}`` where ``model_name`` is
    the model path vLLM was started with and ``kv_rank`` encodes world size / rank (TP=1: 0x01000100).
    """

    model_name: str
    chunk_size: int = 256
    kv_rank: int = 0x01000100
    group: int = 0

    @staticmethod
    def _h(prefix: bytes, tokens: Sequence[int]) -> bytes:
        h = blake3.blake3(prefix)
        h.update(_u32_be(tokens))
        return h.digest()

    def chunk_hashes(self, tokens: Sequence[int]) -> list[bytes]:
        prev = self._h((0).to_bytes(8, "big", signed=True), (0,))
        out = []
        n = len(tokens) - len(tokens) % self.chunk_size
        for i in range(0, n, self.chunk_size):
            prev = self._h(prev, tokens[i : i + self.chunk_size])
            out.append(prev)
        return out

    def redis_keys(self, tokens: Sequence[int], cache_salt: str | None = None) -> list[str]:
        # A salted chunk's key ends in ``@<salt>`` (LMCache ObjectKey serialisation); unsalted keys keep the
        # four-field shape. The chunk hashes themselves do not depend on the salt.
        tail = f"@{cache_salt}" if cache_salt else ""
        return [f"{self.model_name}@{self.kv_rank:08x}@{self.group:x}@{h.hex()}{tail}"
                for h in self.chunk_hashes(tokens)]
