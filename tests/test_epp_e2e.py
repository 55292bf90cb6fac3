"""End to end: the demo's three agents through a data plane that asks kvgate's endpoint picker for every
request and forwards to simulated workers as Envoy's override-host load balancing would (``tests/envoy.py``),
against the same agents through kvgate's own proxy. Both modes must send every turn to the same worker
with the same prompt, the same cached tokens, the same expected cached tokens and the same loss
explanations in the conversation records: the endpoint picker is kvgate's routing, not an approximation.

(Envoy itself cannot run here; docs/epp.md says what only a real one can show.)"""

from __future__ import annotations

from typing import Any

import httpx

from kvgate.assembly import make_client
from kvgate.demo import TurnResult, run_session
from kvgate.serving import start_server
from tests.conftest import Cluster
from tests.envoy import Envoy

AGENTS = ("agent-A", "agent-B", "agent-C")
SIM = {"profile": "h100-llama3-8b", "speed": 20.0}


async def run_agents(url: str) -> list[TurnResult]:
    rows: list[TurnResult] = []
    async with make_client(60.0) as client:
        for conv in AGENTS:  # one after the other: the same traffic, the same decisions, in both modes
            rows += await run_session(client, url, conv)
    return rows


def rank(c: Cluster) -> dict[str, int]:
    """Workers by id order (the cost model breaks ties by id): comparable across two clusters."""
    return {wid: i for i, wid in enumerate(sorted(w.id for w in c.gateway.pool.all()))}


async def records(c: Cluster) -> list[tuple[Any, ...]]:
    out = []
    r = rank(c)
    for conv in AGENTS:
        rec = await c.gateway.store.peek(conv)  # type: ignore[arg-type]
        assert rec is not None
        out += [(conv, r[t.worker], t.reason, t.prompt_tokens, t.cached_tokens, t.expected_cached_tokens, t.tier,
                 t.lost_tokens, t.loss_cause, t.cache_lost_tokens, t.cache_loss_cause) for t in rec.turns]
    return out


def table(c: Cluster, rows: list[TurnResult]) -> list[tuple[Any, ...]]:
    r = rank(c)
    return [(x.conversation, x.kind, r[x.worker], x.reason, x.prompt_tokens, x.cached_tokens, x.expected_cached,
             x.finish) for x in rows]


async def test_demo_agents_through_the_endpoint_picker_match_proxy_mode(make_cluster: Any) -> None:
    # Reasoning dropped from completed turns: the records then carry loss explanations to compare.
    proxy = await make_cluster(3, sim=SIM, events=True, reasoning_policy="drop")
    via_proxy = await run_agents(proxy.url)
    epp = await make_cluster(3, sim=SIM, events=True, epp_port=0, reasoning_policy="drop")
    port = epp.gateway_handle.server.config.app.state.grpc.epp_port
    envoy = Envoy(f"127.0.0.1:{port}")
    dp = await start_server(envoy.app)
    try:
        via_epp = await run_agents(dp.url)
        # The data plane asked the picker for every turn and sent each one where it said.
        assert len(envoy.picks) == len(via_epp)
        assert [p.split(",")[0] for p in envoy.picks] == [x.worker for x in via_epp]
        assert table(epp, via_epp) == table(proxy, via_proxy)
        recs = await records(epp)
        assert recs == await records(proxy)
        print("\n".join(map(str, recs)))
        assert sum(x.cached_tokens for x in via_epp) > 0
        assert any(r[7] > 0 and r[8] == "reasoning_dropped" for r in recs)  # the loss explained alike
        # The picker saw every response end: nothing is left in flight, and every turn was recorded.
        assert all(w.in_flight == 0 and w.pending_requests == 0 for w in epp.gateway.pool.all())
        assert sum(len(r) for r in [await records(epp)]) == len(via_epp)
        async with httpx.AsyncClient() as h:
            models = await h.get(dp.url + "/v1/models")  # no body: the picker's fallback pick
        assert models.status_code == 200 and models.json()["data"]
    finally:
        await dp.stop()
        await envoy.close()


async def test_concurrent_agents_through_the_endpoint_picker_leave_nothing_behind(make_cluster: Any) -> None:
    import asyncio

    epp = await make_cluster(3, sim=SIM, events=True, epp_port=0)
    port = epp.gateway_handle.server.config.app.state.grpc.epp_port
    envoy = Envoy(f"127.0.0.1:{port}", chunks=5)
    dp = await start_server(envoy.app)
    try:
        async with make_client(60.0) as client:
            per = await asyncio.gather(*(run_session(client, dp.url, conv) for conv in AGENTS))
        rows = [r for session in per for r in session]
        assert all(w.in_flight == 0 and w.pending_requests == 0 for w in epp.gateway.pool.all())
        for conv, session in zip(AGENTS, per, strict=True):
            rec = await epp.gateway.store.peek(conv)  # type: ignore[arg-type]
            assert rec is not None and rec.turn_count == len(session)
            assert [t.worker for t in rec.turns] == [r.worker for r in session]
            assert [t.cached_tokens for t in rec.turns] == [r.cached_tokens for r in session]
        assert sum(r.cached_tokens for r in rows) > 0
    finally:
        await dp.stop()
        await envoy.close()
