"""LMCache's multiprocess server (L1 CPU memory, L2 the local Redis) behind a vLLM with a tiny KV cache."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import redis

from kvgate.dev.engines import EngineSet, Proc, VllmWorker, ensure_lmcache, free_port, metric_total
from kvgate.router.hashing import LMCacheKeys
from tests.engine.conftest import SMALL_BLOCKS, cached, complete


@dataclass
class LMCacheSetup:
    vllm: Proc
    lmcache: Proc
    model: Path


@pytest.fixture(scope="module")
def lmc(tmp_path_factory: pytest.TempPathFactory, real_model: Path) -> Iterator[LMCacheSetup]:
    ensure_lmcache()
    r = redis.Redis()
    stale = r.keys(f"{real_model}@*")
    if stale:
        r.delete(*stale)  # only LMCache's keys for this model path: the Redis is shared
    s = EngineSet(run_dir=tmp_path_factory.mktemp("lmcache"))
    try:
        port = free_port()
        lm = s.start_lmcache(port, free_port())
        (vl,) = s.start_vllm([VllmWorker(port=free_port(), core=0, num_gpu_blocks=SMALL_BLOCKS, lmcache_port=port)],
                             real_model)
        yield LMCacheSetup(vl, lm, real_model)
    finally:
        s.stop()


def by_source(url: str) -> dict[str, float]:
    return {src: metric_total(url, "vllm:prompt_tokens_by_source_total", source=src)
            for src in ("local_compute", "local_cache_hit", "external_kv_transfer")}


def lmcache_hits(url: str) -> dict[str, float]:
    return {tier: metric_total(url, f"lmcache_mp_lookup_hit_{tier}_tokens_total") for tier in ("l1", "l2")}


def prompt(seed: int, n: int = 1300) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(10, 3000) for _ in range(n)]


async def evict(url: str, seeds: range) -> None:
    for s in seeds:  # 4 x 1300 tokens overflow the worker's 5,120-token cache
        await complete(url, prompt(s))


async def test_evicted_conversation_comes_back_from_l1_then_redis(lmc: LMCacheSetup) -> None:
    url, lm = lmc.vllm.url, lmc.lmcache.url
    conv = prompt(1)
    assert cached(await complete(url, conv)) == 0
    await evict(url, range(100, 104))
    before, hits0 = by_source(url), lmcache_hits(lm)
    again = await complete(url, conv)
    after, hits1 = by_source(url), lmcache_hits(lm)
    external = after.get("external_kv_transfer", 0) - before.get("external_kv_transfer", 0)
    assert external == 1280 and cached(again) == 1280  # 5 whole 256-token chunks
    assert hits1.get("l1", 0) - hits0.get("l1", 0) == 1280

    # Clear LMCache's L1: the chunks now live only in Redis.
    async with httpx.AsyncClient() as c:
        assert (await c.post(lm + "/cache/clear")).json()["cleared"] == {"tier": "l1"}
    await evict(url, range(200, 204))
    before, hits0 = by_source(url), lmcache_hits(lm)
    third = await complete(url, conv)
    after, hits1 = by_source(url), lmcache_hits(lm)
    assert after.get("external_kv_transfer", 0) - before.get("external_kv_transfer", 0) == 1280
    assert cached(third) == 1280
    assert hits1.get("l2", 0) - hits0.get("l2", 0) == 1280


async def test_kvgate_computes_exactly_the_redis_keys(lmc: LMCacheSetup) -> None:
    url = lmc.vllm.url
    sent = [prompt(7), prompt(8, 700), prompt(7)[:600] + prompt(9, 300)]
    for p in sent:
        await complete(url, p)
    keys = LMCacheKeys(model_name=str(lmc.model))
    r = redis.Redis()
    want = {k for p in sent for k in keys.redis_keys(p)}
    assert want and all(r.exists(k) for k in want)
    present = {k.decode() for k in r.keys(f"{lmc.model}@*")}
    earlier = {k for s in [1, *range(100, 104), *range(200, 204)] for k in keys.redis_keys(prompt(s))}
    assert present == want | earlier

