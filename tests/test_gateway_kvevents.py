"""Workers that restart under a running gateway: never routed to with their old blocks expected."""

from __future__ import annotations

from typing import Any

from kvgate.assembly import create_app
from kvgate.router.types import WorkerId
from kvgate.serving import start_server
from kvgate.sim.server import SimWorker
from tests.conftest import Cluster
from tests.helpers import agent_turns, eventually, metric


async def restart_in_place(c: Cluster, wid: str) -> None:
    """Stop the worker and start a fresh one (empty cache, new event publisher) on the same ports."""
    old, h = c.worker_by_id(wid)
    await h.stop()
    new = SimWorker(old.settings)
    c.sims[c.sims.index((old, h))] = (new, await start_server(new.build_app(), port=h.port))


async def test_the_event_connection_drop_catches_a_restart_between_health_checks(make_cluster: Any) -> None:
    # The health poll is too slow to see it: the SUB socket's monitor does.
    c = await make_cluster(2, events=True, health_interval_s=60)
    gw = c.gateway
    await eventually(lambda: len(gw.prefix.events.workers()) == 2)
    turns = await agent_turns(c, "r1", 2)
    home = WorkerId(turns[-1][0])
    assert turns[-1][4] > 0
    await restart_in_place(c, home)
    await eventually(lambda: gw.subscriber.disconnects == 1 and gw.prefix.events.stats.resyncs == 3
                     and not gw.prefix.events.stale(home))
    assert gw.prefix.index.block_count(home) == 0
    assert await metric(c, "kvgate_kv_event_disconnects_total") == 1
    after = await agent_turns(c, "r1b", 1, system="You are an agent. " * 60)  # same system prompt, new task
    assert after[0][3] == after[0][4]
    again = await agent_turns(c, "r1", 1)
    assert again[0][3] == again[0][4]


async def test_the_health_poll_catches_a_restart_of_a_worker_without_events(make_cluster: Any) -> None:
    c = await make_cluster(2, events=False, health_interval_s=0.1)
    gw = c.gateway
    turns = await agent_turns(c, "r2", 2)
    home = WorkerId(turns[-1][0])
    assert turns[-1][4] > 0  # the approximate index expects the conversation there
    await restart_in_place(c, home)
    await eventually(lambda: sum(n for (w, _), n in gw.pool.restarts.items() if w == home) >= 1
                     and gw.pool.get(home).healthy)
    nxt = await agent_turns(c, "r2", 1)
    assert nxt[0][3] == nxt[0][4]
    assert gw.prefix.approx.index.block_count(home) <= nxt[0][2] // 128  # only what this turn recorded


async def test_a_gateway_that_starts_knows_the_workers_caches_before_its_first_request(make_cluster: Any) -> None:
    c = await make_cluster(2, events=True)
    await eventually(lambda: len(c.gateway.prefix.events.workers()) == 2)
    await agent_turns(c, "w1", 2)
    for warm in (False, True):
        # Another replica starts in front of the same workers: no request has reached it yet.
        settings = c.gateway.settings.model_copy(update={"kv_events_warm_start": warm})
        replica = Cluster(gateway_handle=await start_server(create_app(settings)))
        try:
            first = await agent_turns(replica, "w1", 1)
            _, _, _, cached, expected = first[0]
            assert cached > 0
            assert (expected == cached) is warm, (warm, expected, cached)
        finally:
            await replica.close()
