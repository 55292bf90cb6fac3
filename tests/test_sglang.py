"""kvgate's SGLang page identity against vectors SGLang 0.5.23 produced itself (its native
``get_hash_str``, ``get_storage_hash_str``, ``hash_str_to_int64`` and ``namespaced_block_hash``, run on CPU
in the engine venv; ``tests/engine/test_sglang_parity.py`` re-checks them live on many more sequences)."""

import random

import pytest

from kvgate.router.sglang import HiCacheFileKeys, SglangHasher, chain, event_int, event_seed

_rng = random.Random(5)
TOKENS = [_rng.randrange(0, 150000) for _ in range(37)] + [2**33]
# get_hash_str(TOKENS[:37], None, page_size=P)[:2] for P in 1, 4, 16 (SGLang also hashes a trailing
# partial page; its radix tree never keys one, so kvgate stops at full pages).
PAGES = {
    1: [
        'e157496147e4b9f761c90a5a4adf9d0f59c81169d833a4b94141f159cf93ca7c',
        '8b09c90970f59335e8fb369de68ce313bcffc15733bb1a8049a6fa755aa7c762',
    ],
    4: [
        'c55929a812f4ef2aef9dd412409524884eb78c0a0b0b262ab82a3b7fb2cefd52',
        '168646a34a55c3b69dad1b876bf8785c47fa00303effe0b136c199fc0274f1c0',
    ],
    16: [
        '8e6c67d44757d94848e740c6e9b99794ccc24b6cad1fbb7f3271e23d10847c13',
        '73a05e6a8ef9f388873cf7d95d0b2f392f0792ab2fce4d4f686c014afe5c7954',
    ],
}
# Page 2 of get_hash_str(TOKENS[:32] + [2**33] + ..., page_size=16): the wide id only changes page 3.
WIDE_LAST = '73a05e6a8ef9f388873cf7d95d0b2f392f0792ab2fce4d4f686c014afe5c7954'
INT64 = [-8184052261411366584, 8331763122393707400]
# namespaced_block_hash(INT64[i], kv_event_namespace_seed(extra_key="ek"))
LORA_NS = [305585388721358783, 8191930337695720217]
# get_storage_hash_str(RadixKey(TOKENS[:32], extra_key="lora-x", cache_salt="s"), None, 16)
STORAGE_NS = [
    'f0e0805283d02abea4603b3fa1e9d661fd96bab3ce043a63c9e6a0652e2599b0',
    '603efae4a2cfcc1d32d75f558ce7dffe6a85074541760bafc40d11a9d86f3b99',
]


@pytest.mark.parametrize("page", [1, 4, 16])
def test_page_chain_matches_sglang(page: int) -> None:
    got = [h.hex() for h in SglangHasher(page).block_hashes(TOKENS[:37])]
    assert got[:2] == PAGES[page]
    assert len(got) == 37 // page  # full pages only


def test_event_ids_are_the_first_8_bytes_signed() -> None:
    hs = SglangHasher(16).block_hashes(TOKENS[:32])
    assert [event_int(h) for h in hs] == INT64
    assert SglangHasher(16).event_ints(hs, lora_extra_key="ek") == LORA_NS
    assert SglangHasher(16).event_ints(hs) == INT64


def test_wide_token_pages_are_tagged() -> None:
    wide = TOKENS[:32] + [TOKENS[-1]] + [0] * 15
    hs = chain(wide, 16, None)
    assert hs[1].hex() == WIDE_LAST and hs[2].hex() not in PAGES[16]


def test_storage_keys_are_namespaced_by_extra_key_and_salt() -> None:
    keys = HiCacheFileKeys("org/model", 16)
    assert keys.page_keys(TOKENS[:32], "lora-x", "s") == STORAGE_NS
    assert keys.page_keys(TOKENS[:32]) == PAGES[16]
    assert keys.file_names(TOKENS[:16])[0] == f"{PAGES[16][0]}_org-model_0_1.bin"
    assert HiCacheFileKeys("m", 16, mla=True, pp_size=2, pp_rank=1).suffix == "_m_2_1"


def test_salt_seeds_only_the_first_page_and_chains_continue() -> None:
    h = SglangHasher(4)
    salted = h.block_hashes(TOKENS[:16], cache_salt="tenant")
    assert salted[0] == chain(TOKENS[:4], 4, event_seed("tenant"))[0] != h.block_hashes(TOKENS[:4])[0]
    assert h.block_hashes(TOKENS[8:16], parent=salted[1], start_block=2) == salted[2:]
    assert h.block_hashes(TOKENS[:16], cache_salt="") == h.block_hashes(TOKENS[:16])
    with pytest.raises(ValueError):
        h.block_hashes(TOKENS[4:8], start_block=1)
    with pytest.raises(ValueError):
        SglangHasher(0)
