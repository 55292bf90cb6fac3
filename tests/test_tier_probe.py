"""The remote-tier probe against real Redis: LMCache's keys found by EXISTS, and a Redis that goes away
and comes back (a redis-server of the test's own, on its own port)."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from collections.abc import Iterator

import pytest
import redis

from kvgate.kvstore.tiers import RemoteTierProbe
from kvgate.router.hashing import LMCacheKeys
from tests.conftest import free_port

MODEL = "/models/kvgate-probe-test"


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t


@pytest.fixture
def keys() -> Iterator[list[str]]:
    r = redis.Redis()
    made: list[str] = []
    yield made
    if made:
        r.delete(*made)


async def test_longest_run_of_present_chunks(keys: list[str]) -> None:
    toks = list(range(1, 1400))  # 5 full 256-token chunks
    want = LMCacheKeys(MODEL).redis_keys(toks)
    r = redis.Redis()
    for k in want[:3] + want[4:]:  # chunk 3 is missing: only the first three count
        r.set(k, b"kv")
        keys.append(k)
    probe = RemoteTierProbe("redis://127.0.0.1:6379/0", Clock().now)
    try:
        assert await probe.prefix_tokens(MODEL, toks) == 768
        assert await probe.prefix_tokens(MODEL, toks[:200]) == 0  # not one full chunk
        assert await probe.prefix_tokens("/models/other", toks) == 0
        assert probe.breaker.up and probe.breaker.errors == 0
    finally:
        await probe.aclose()


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")
async def test_a_redis_that_goes_away_reads_as_empty_and_is_used_again_when_back(tmp_path: object) -> None:
    port = free_port()
    clock = Clock()
    probe = RemoteTierProbe(f"redis://127.0.0.1:{port}/0", clock.now, retry_s=5.0, timeout_s=0.2)
    toks = list(range(1, 600))
    try:
        assert await probe.prefix_tokens(MODEL, toks) == 0  # nobody listens yet
        assert not probe.breaker.up and probe.breaker.errors == 1
        assert await probe.prefix_tokens(MODEL, toks) == 0 and probe.breaker.errors == 1  # not retried yet
        srv = await asyncio.create_subprocess_exec("redis-server", "--port", str(port), "--save", "",
                                                   "--appendonly", "no", stdout=subprocess.DEVNULL,
                                                   stderr=subprocess.DEVNULL)
        try:
            r = redis.Redis(port=port)
            for _ in range(100):
                try:
                    r.ping()
                    break
                except redis.ConnectionError:
                    await asyncio.sleep(0.05)
            for k in LMCacheKeys(MODEL).redis_keys(toks):
                r.set(k, b"kv")
            clock.t = 6.0  # the retry interval has passed
            assert await probe.prefix_tokens(MODEL, toks) == 512
            assert probe.breaker.up
        finally:
            srv.terminate()
            await asyncio.wait_for(srv.wait(), 10)
    finally:
        await probe.aclose()


def test_the_coordinators_placements_read_as_prefixes_per_tier_and_instance() -> None:
    from kvgate.kvstore.lmcache_coordinator import prefix_by_tier

    def key(*placements: tuple[str, str]) -> dict[str, object]:
        return {"placements": [{"instance_id": i, "tier": t} for i, t in placements]}

    a1, b1, l2 = ("a", "l1"), ("b", "l1"), ("a", "l2")
    # Chunk by chunk (LMCache 0.5.6's reply order): a's L1 holds three, b's the first only, L2 two (then a gap).
    results = [key(a1, b1, l2), key(a1, l2), key(a1), key(l2)]
    got = prefix_by_tier(4, results, 256)
    assert got.l1 == {"a": 768, "b": 256} and got.l2 == 512
    # Two keys per chunk (ranks or object groups): a chunk counts only when every one of its keys is there.
    assert prefix_by_tier(2, [key(a1, l2), key(a1), key(a1, l2), key(a1, l2)], 256).l2 == 0
    assert prefix_by_tier(2, [key(a1, l2), key(a1), key(a1, l2), key(a1, l2)], 256).l1 == {"a": 512}
    assert prefix_by_tier(0, [], 256).l2 == 0 and prefix_by_tier(3, [key(a1)] * 2, 256).l1 is None
