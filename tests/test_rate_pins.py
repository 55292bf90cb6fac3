"""An operator's tier load rate wins over the learned one (gateway/policyedit.py RatePins, gateway/tierview.py,
gateway/policysync.py): three replicas on one Redis learning ``remote_load_gbps`` from an LMCache server's
metrics; a PATCH pins it on all of them through their learning, a PATCH with null gives it back."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import PlainTextResponse

from kvgate.assembly import create_app
from kvgate.config import GatewaySettings, WorkerConfig
from kvgate.gateway.policyedit import pin_rates
from kvgate.serving import start_server
from tests.conftest import MODEL, Cluster

REDIS = "redis://127.0.0.1:6379/0"
L2_GBPS = 0.5
LEARNED = 1 / (1 / L2_GBPS + 1 / 20.0)
"""The L2 leg in series with the configured L1 rate (20 GB/s): what the replicas learn."""
H = "lmcache_mp_l2_load_throughput_GB_per_second"


def lmcache_metrics() -> FastAPI:
    """An LMCache server's ``/metrics``: one more L2 load at 0.5 GB/s every scrape, so every scrape is a sample."""
    app = FastAPI()
    loads = [0]

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        loads[0] += 1
        n = loads[0]
        return PlainTextResponse(f"# HELP {H} L2 load throughput.\n# TYPE {H} histogram\n"
                                 f'{H}_bucket{{le="+Inf"}} {n}\n{H}_count {n}\n{H}_sum {n * L2_GBPS}\n')

    return app


def gateways(c: Cluster) -> list[Any]:
    return [r.server.config.app.state.gateway for r in c.replicas]


async def until(pred: Any, timeout_s: float = 5.0) -> None:
    start = time.monotonic()
    while not await pred():
        assert time.monotonic() - start < timeout_s, "not within the time"
        await asyncio.sleep(0.05)


async def samples_after(gws: list[Any], n: int = 2) -> None:
    """Until every replica has folded in ``n`` more learning samples."""
    seen = [g.tiers.rates.l2.samples for g in gws]

    async def learned() -> bool:
        return all(g.tiers.rates.l2.samples >= s + n for g, s in zip(gws, seen, strict=True))

    await until(learned)


async def views(urls: list[str], path: str) -> list[dict[str, Any]]:
    async with httpx.AsyncClient() as h:
        return [(await h.get(u + path)).json() for u in urls]


async def remote_everywhere(urls: list[str], gbps: float, source: str) -> bool:
    pol, tiers = await views(urls, "/admin/policy"), await views(urls, "/admin/tiers")
    return all(p["cost"]["remote_load_gbps"] == pytest.approx(gbps) and p["rate_sources"]["remote_load_gbps"] == source
               and t["load_rates"]["remote_load_gbps"] == {"gbps": pytest.approx(gbps), "source": source}
               for p, t in zip(pol, tiers, strict=True))


async def test_a_patched_rate_survives_learning_on_every_replica_until_cleared(make_cluster: Any) -> None:
    lm = await start_server(lmcache_metrics())
    prefix = f"kvt-pins-{uuid.uuid4().hex[:8]}:"
    try:
        c = await make_cluster(1, replicas=3, session_store="redis", redis_url=REDIS, redis_prefix=prefix,
                               tier_rates_interval_s=0.1, worker={"lmcache_url": lm.url})
        gws = gateways(c)
        await until(lambda: remote_everywhere(c.urls, LEARNED, "learned"))
        async with httpx.AsyncClient() as h:
            r = await h.patch(c.urls[0] + "/admin/policy", json={"cost": {"remote_load_gbps": 9.0}, "reason": "iperf"})
            assert r.status_code == 200, r.text
            assert r.json()["rate_sources"] == {"cpu_load_gbps": "configured", "remote_load_gbps": "operator"}
            await until(lambda: remote_everywhere(c.urls, 9.0, "operator"))
            await samples_after(gws)  # the learning that used to overwrite it at its next sample
            assert await remote_everywhere(c.urls, 9.0, "operator")
            assert all(g.cost.params.remote_load_gbps == 9.0 for g in gws)  # what the router prices with
            (change,) = gws[2].policy_log.recent(1)
            assert {(f.field, f.new) for f in change.changes} == {("remote_load_gbps", 9.0),
                                                                 ("pinned.remote_load_gbps", 9.0)}

            # A replica that joins now takes the pin before it serves, and keeps it through its own learning.
            w, handle = c.sims[0]
            settings = GatewaySettings(
                workers=[WorkerConfig(url=handle.url, model=MODEL, engine="sim", block_size=w.profile.block_size,
                                      lmcache_url=lm.url)],
                session_store="redis", redis_url=REDIS, redis_prefix=prefix, hash_seed="0", tier_rates_interval_s=0.1)
            late = await start_server(create_app(settings))
            try:
                lg = late.server.config.app.state.gateway
                assert lg.policy_sync.version == 1, (lg.policy_sync.status(), lg.tiers.rate_sources())
                assert lg.cost.params.remote_load_gbps == 9.0, (lg.tiers.pinned, lg.tiers.rate_sources())
                assert lg.tiers.rate_sources()["remote_load_gbps"] == "operator"
                await samples_after([lg])
                assert lg.cost.params.remote_load_gbps == 9.0
            finally:
                await late.stop()

            # Cleared on another replica: every replica's learned value is back at once, and learning goes on.
            r = await h.patch(c.urls[1] + "/admin/policy", json={"cost": {"remote_load_gbps": None}})
            assert r.status_code == 200, r.text
            assert r.json()["rate_sources"]["remote_load_gbps"] == "learned"
            await until(lambda: remote_everywhere(c.urls, LEARNED, "learned"))
            await samples_after(gws)
            assert await remote_everywhere(c.urls, LEARNED, "learned")
            # With nothing pinned the document has no such section: a replica of the version before this
            # one (which refuses a section it does not know) still applies every edit.
            doc = (await gws[0].policy_sync.store.read()).doc
            assert doc.version == 2 and "pinned" not in doc.sections

            # Out of range or not a number: refused whole, nothing pinned.
            for bad in ({"cost": {"remote_load_gbps": 0}}, {"pinned": {"remote_load_gbps": -1}},
                        {"cost": {"remote_load_gbps": "fast"}}, {"pinned": {"decode_ms": 1}},
                        {"cost": {"remote_load_gbps": 1e300}}):
                r = await h.patch(c.urls[2] + "/admin/policy", json=bad)
                assert r.status_code == 422, (bad, r.text)
            assert await remote_everywhere(c.urls, LEARNED, "learned")
    finally:
        await lm.stop()


def test_an_edit_of_a_learned_rate_pins_it_and_a_null_clears_the_pin() -> None:
    assert pin_rates({"cost": {"decode_ms": 2, "remote_load_gbps": 3}}) == {
        "cost": {"decode_ms": 2, "remote_load_gbps": 3}, "pinned": {"remote_load_gbps": 3}}
    assert pin_rates({"cost": {"cpu_load_gbps": None}, "waits": {"quantile": 0.5}}) == {
        "waits": {"quantile": 0.5}, "pinned": {"cpu_load_gbps": None}}
    for untouched in ({"cost": {"decode_ms": 2}}, {"waits": {}}, [], {"cost": 3}, {"cost": {"cpu_load_gbps": 1},
                                                                                     "pinned": 5}):
        assert pin_rates(untouched) == untouched
