"""Page hashes, KV-event ids and HiCache storage keys exactly as SGLang 0.5.23 computes them.

SGLang (``srt/mem_cache/utils.py``, ``cpp_utils/hash_binding.cpp``) chains SHA-256 over pages:
``h_i = sha256(h_{i-1} || tokens_i)`` with the tokens as little-endian u32 (a page holding a token id
above 2^32 is hashed as ``0xff || u64_le...`` instead), ``h_{-1}`` absent (no prefix bytes at all) unless
the chain is namespaced. The native binding hashes every page including a trailing partial one, but the
radix tree only ever keys page-aligned prefixes (``RadixKey.page_aligned``), so only full pages reach
events or storage.

Three chains share this function and differ only in their seed (``h_{-1}``):
- **KV events** (``compute_node_event_hash_values``): unseeded, or with a ``cache_salt`` seeded by
  ``sha256(b"sglang-cache-salt-v1\\0" + salt)``; ``extra_key`` does not enter;
- **HiCache storage** (``get_storage_hash_str``): seeded by ``storage_namespace_seed(extra_key,
  cache_salt)`` when either is set;
- the two coincide for requests with neither.

An event carries ``hash_str_to_int64``: the FIRST 8 bytes of the digest, big-endian, as a SIGNED int64
(vLLM publishes the last 8, unsigned). A LoRA adapter (an ``extra_key`` ending in a registered lora id)
or ``format: "dynamo"`` further maps each id through ``namespaced_block_hash``.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from kvgate.router.hashing import BlockHash

_SALT_TAG = b"sglang-cache-salt-v1\0"
_STORAGE_TAG = b"sglang-cache-namespace-v1"
_EVENT_NS_TAG = b"sglang-kv-event-namespace-v1"
_U32_MAX = 0xFFFF_FFFF


def _le_bytes(tokens: Sequence[int], typecode: str) -> bytes:
    arr = array(typecode, tokens)
    if sys.byteorder != "little":  # pragma: no cover - SGLang itself refuses big-endian hosts
        arr.byteswap()
    return arr.tobytes()


def _page_bytes(tokens: Sequence[int]) -> bytes:
    if any(t < 0 for t in tokens):
        raise ValueError("token ids must be non-negative")
    if max(tokens, default=0) > _U32_MAX:
        # The odd leading byte keeps a wide page from ever equalling a u32 page.
        return b"\xff" + _le_bytes(tokens, "Q")
    return _le_bytes(tokens, "I")


def page_digest(prior: bytes | None, tokens: Sequence[int]) -> bytes:
    """One link of SGLang's chain (``get_hash_str`` of one page)."""
    h = hashlib.sha256()
    if prior is not None:
        h.update(prior)
    h.update(_page_bytes(tokens))
    return h.digest()


def _namespace_digest(tag: bytes, extra_key: str | None, cache_salt: str | None) -> bytes:
    digest = hashlib.sha256(tag)
    # A presence byte and a length prefix keep ("a", "bc") apart from ("ab", "c").
    for part in (extra_key, cache_salt):
        if part is None:
            digest.update(b"\x00")
            continue
        encoded = part.encode("utf-8")
        digest.update(b"\x01" + len(encoded).to_bytes(8, "little") + encoded)
    return digest.digest()


def event_seed(cache_salt: str | None) -> bytes | None:
    """The seed of the event chain: the salt's, or none (``extra_key`` never enters it)."""
    return hashlib.sha256(_SALT_TAG + cache_salt.encode("utf-8")).digest() if cache_salt else None


def storage_seed(extra_key: str | None, cache_salt: str | None) -> bytes | None:
    """``storage_namespace_seed``: the seed of HiCache storage chains."""
    if extra_key is None and not cache_salt:
        return None
    return _namespace_digest(_STORAGE_TAG, extra_key, cache_salt or None)


def event_namespace_seed(extra_key: str | None, cache_salt: str | None) -> bytes | None:
    """``kv_event_namespace_seed``: what ``namespaced_block_hash`` mixes into a published id."""
    if extra_key is None and cache_salt is None:
        return None
    return _namespace_digest(_EVENT_NS_TAG, extra_key, cache_salt)


def event_int(h: bytes) -> int:
    """``hash_str_to_int64``: the digest's first 8 bytes, big-endian, signed."""
    return int.from_bytes(h[:8], "big", signed=True)


def namespaced_event_int(block_id: int, seed: bytes | None) -> int:
    """``namespaced_block_hash``: a published id re-keyed by a LoRA / dynamo-format namespace."""
    if seed is None:
        return block_id
    d = hashlib.sha256(seed + block_id.to_bytes(8, "big", signed=True)).digest()
    return int.from_bytes(d[:8], "big", signed=True)


def chain(tokens: Sequence[int], page_size: int, seed: bytes | None) -> list[bytes]:
    """Digests of the full pages of ``tokens``, the first chained onto ``seed``."""
    prev = seed
    out: list[bytes] = []
    for i in range(0, len(tokens) - len(tokens) % page_size, page_size):
        prev = page_digest(prev, tokens[i : i + page_size])
        out.append(prev)
    return out


@dataclass(frozen=True, slots=True)
class SglangHasher:
    """One SGLang worker's page identity: ``block_size`` is its ``--page-size`` (1 by default on GPUs, so
    one hash per token). The same shape as ``VllmHasher``, so a per-worker factory can pick either.

    ``lora_extra_key``: the ``extra_key`` SGLang builds for a LoRA request (the request's ``extra_key`` +
    the adapter's ``lora_id``); when the worker knows the adapter's name its events are namespaced by it.
    ``dynamo_format``: the worker runs ``--kv-events-config '{"format": "dynamo", ...}'``.
    """

    block_size: int
    dynamo_format: bool = False

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError("block_size (SGLang's page size) must be positive")

    def block_hashes(
        self,
        token_ids: Sequence[int],
        *,
        parent: BlockHash | None = None,
        cache_salt: str | None = None,
        start_block: int = 0,
    ) -> list[BlockHash]:
        """Event-chain digests of the full pages of ``token_ids``; ``parent``/``start_block`` continue a
        chain (the salt seeds only a chain's first page)."""
        seed = parent if parent is not None else (event_seed(cache_salt) if start_block == 0 else None)
        if parent is None and start_block > 0:
            raise ValueError("continuing a chain needs its parent hash")
        return [BlockHash(h) for h in chain(token_ids, self.block_size, seed)]

    @staticmethod
    def event_int(h: bytes) -> int:
        return event_int(h)

    def event_ints(self, hashes: Sequence[bytes], *, cache_salt: str | None = None,
                   lora_extra_key: str | None = None) -> list[int]:
        """The ids this worker's events carry for ``hashes`` (namespaced where SGLang namespaces them)."""
        if self.dynamo_format:
            seed = event_namespace_seed(lora_extra_key, cache_salt or None)
        else:
            seed = event_namespace_seed(lora_extra_key, None) if lora_extra_key is not None else None
        return [namespaced_event_int(event_int(h), seed) for h in hashes]


@dataclass(frozen=True, slots=True)
class HiCacheFileKeys:
    """The files SGLang's HiCache ``file`` storage backend writes for a token sequence (rank-suffix key
    scheme, the default): ``{dir}/{page_hex}_{model}_{tp_rank}_{tp_size}.bin`` per full page, ``model``
    being the served model path with ``/`` turned into ``-`` (MLA models drop the tp suffix; pipeline
    parallelism adds ``_{pp_size}_{pp_rank}``)."""

    model_name: str
    page_size: int
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    mla: bool = False

    @property
    def suffix(self) -> str:
        model = "-".join(self.model_name.split("/")) if self.model_name else ""
        shard = f"_{self.pp_size}_{self.pp_rank}" if self.pp_size > 1 else ""
        return f"_{model}{shard}" if self.mla else f"_{model}_{self.tp_rank}_{self.tp_size}{shard}"

    def page_keys(self, tokens: Sequence[int], extra_key: str | None = None,
                  cache_salt: str | None = None) -> list[str]:
        """``get_storage_hash_str`` of every full page, hex, as the backend's key."""
        return [h.hex() for h in chain(tokens, self.page_size, storage_seed(extra_key, cache_salt))]

    def file_names(self, tokens: Sequence[int], extra_key: str | None = None,
                   cache_salt: str | None = None) -> list[str]:
        return [f"{k}{self.suffix}.bin" for k in self.page_keys(tokens, extra_key, cache_salt)]
