"""Runs SGLang's own code inside its venv (``~/.cache/kvgate/engines/venv-sglang``) and answers on stdout what
it computes for the cases on stdin: page hashes, storage hashes, and the KV event batches its real
``RadixCache`` publishes (encoded by its own msgspec structs) for a sequence of inserts, lookups,
evictions and flushes. Not imported by kvgate: ``test_sglang_parity.py`` runs it as a subprocess.

Two stubs, the smallest the imports need on a machine without a GPU stack (both only satisfy imports;
no stubbed name is called):
- ``sglang.srt.mem_cache.memory_pool`` (its ``ReqToTokenPool`` is only a type here): the real module pulls
  in the attention backends and GPU kernels;
- ``torchvision`` (a few multimodal model configs import it at module level): PyPI's torchvision needs
  another torch than the CPU build installed here. ``transformers`` is imported first, so it still
  sees no torchvision.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import types
from array import array
from typing import Any


def _stub_imports() -> None:
    pool = types.ModuleType("sglang.srt.mem_cache.memory_pool")
    pool.ReqToTokenPool = type("ReqToTokenPool", (), {})  # type: ignore[attr-defined]
    sys.modules[pool.__name__] = pool
    # Imported first so transformers decides "no torchvision" before the stub exists.
    for mod in ("transformers.image_utils", "transformers.models.auto.processing_auto"):
        importlib.import_module(mod)

    names = ("torchvision", "torchvision.transforms", "torchvision.transforms.functional")
    mods = {n: types.ModuleType(n) for n in names}
    mode = type("InterpolationMode", (), {"BICUBIC": 3})
    mods["torchvision"].transforms = mods["torchvision.transforms"]  # type: ignore[attr-defined]
    mods["torchvision.transforms"].functional = mods["torchvision.transforms.functional"]  # type: ignore[attr-defined]
    mods["torchvision.transforms"].InterpolationMode = mode  # type: ignore[attr-defined]
    mods["torchvision.transforms.functional"].InterpolationMode = mode  # type: ignore[attr-defined]
    sys.modules.update(mods)


def _trace(case: dict[str, Any]) -> dict[str, Any]:
    import msgspec
    from sglang.srt.disaggregation.kv_events import KVEventBatch
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.events import KvEventLoraNames
    from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

    names = KvEventLoraNames()
    for extra_key, lora_id, name in case.get("lora", []):
        names.register(types.SimpleNamespace(extra_key=extra_key, lora_id=lora_id), name)
    alloc = types.SimpleNamespace(device="cpu", free_segment=lambda *a, **k: None)
    tree = RadixCache.create_simulated(mock_allocator=alloc, page_size=case["page_size"],
                                       enable_kv_cache_events=True,
                                       dynamo_kv_event_format=case.get("dynamo", False),
                                       kv_event_lora_names=names)
    enc = msgspec.msgpack.Encoder()
    tree.kv_events.take()  # the AllBlocksCleared of construction
    batches, matches = [], []
    for op in case["ops"]:
        if op[0] in ("insert", "match"):
            key = RadixKey(array("q", op[1]), extra_key=op[2], cache_salt=op[3])
            if op[0] == "insert":
                tree.insert(InsertParams(key=key))
            else:
                matches.append(tree.match_prefix(MatchPrefixParams(key=key)).device_prefix_len)
        elif op[0] == "evict":
            tree.evict(EvictParams(num_tokens=op[1]))
        else:
            tree.reset()
        events = tree.kv_events.take()
        batches.append(enc.encode(KVEventBatch(ts=0.0, events=events, attn_dp_rank=0)).hex() if events else None)
    return {"batches": batches, "matches": matches}


def _hashes(case: dict[str, Any]) -> dict[str, Any]:
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.utils import get_hash_str, get_storage_hash_str

    toks, ps = case["tokens"], case["page_size"]
    key = RadixKey(array("q", toks), extra_key=case.get("extra_key"), cache_salt=case.get("cache_salt"))
    return {"pages": get_hash_str(toks, None, page_size=ps), "storage": get_storage_hash_str(key, None, ps)}


def _file_backend(case: dict[str, Any]) -> dict[str, Any]:
    """Writes the first ``write`` pages of ``tokens`` through SGLang's own ``HiCacheFile`` backend."""
    import torch
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    cfg = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                               is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
                               model_name=case["model_name"])
    backend = HiCacheFile(cfg, file_path=case["dir"])
    key = RadixKey(array("q", case["tokens"]), extra_key=case.get("extra_key"), cache_salt=case.get("cache_salt"))
    full = len(case["tokens"]) // case["page_size"] * case["page_size"]
    hashes = get_storage_hash_str(key[:full], None, case["page_size"])
    written = [backend.set(h, torch.zeros(8)) for h in hashes[: case["write"]]]
    return {"written": written, "files": sorted(os.listdir(case["dir"]))}


def main() -> None:
    _stub_imports()
    req = json.load(sys.stdin)
    import sglang

    out = {"version": sglang.__version__,
           "hashes": [_hashes(c) for c in req.get("hashes", [])],
           "traces": [_trace(c) for c in req.get("traces", [])],
           "files": [_file_backend(c) for c in req.get("files", [])]}
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
