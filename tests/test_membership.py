"""Workers that come and go under a running gateway, found by DNS (a real dnsmasq on loopback): joins get
traffic only once healthy and subscribed, leaves are drained with no failed request."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvgate.assembly import Gateway, create_app
from kvgate.config import DnsDiscovery, GatewaySettings, WorkerTemplate
from kvgate.router.types import ConversationId, WorkerId
from kvgate.serving import ServerHandle, start_server
from kvgate.sim.server import SimWorker
from kvgate.sim.settings import SimSettings
from tests.conftest import MODEL, free_port
from tests.dnsmasq import DOMAIN, Dnsmasq
from tests.helpers import eventually, metric

NAME = f"workers.{DOMAIN}"


@pytest.fixture
def dnsmasq(tmp_path: Path) -> Iterator[Dnsmasq]:
    d = Dnsmasq(tmp_path)
    d.write({})
    d.start()
    yield d
    d.stop()


class Fleet:
    """Simulated workers on 127.0.0.N, all on the same ports, as pods behind a headless Service."""

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = model_dir
        self.http, self.events, self.replay = free_port(), free_port(), free_port()
        self.up: dict[str, ServerHandle] = {}

    async def start(self, ip: str) -> None:
        w = SimWorker(SimSettings(model_dir=str(self.model_dir), hash_seed="0", speed=20.0,
                                  kv_events_endpoint=f"tcp://{ip}:{self.events}",
                                  kv_replay_endpoint=f"tcp://{ip}:{self.replay}"))
        self.up[ip] = await start_server(w.build_app(), host=ip, port=self.http)

    async def stop(self, ip: str) -> None:
        await self.up.pop(ip).stop()

    def wid(self, ip: str) -> WorkerId:
        return WorkerId(f"{ip}:{self.http}")


class Traffic:
    """Agents sending requests all along (streams, so some are in flight on a worker when it leaves)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.seen: list[tuple[int, str, str, int]] = []
        """(status, worker, conversation, the request's number in the order they were sent)."""
        self.sent = 0
        self._stop = asyncio.Event()

    async def agent(self, n: int) -> None:
        async with httpx.AsyncClient(timeout=30) as h:
            i = 0
            while not self._stop.is_set():
                body = {"model": MODEL, "stream": True, "sim": {"reasoning_tokens": 20},
                        "messages": [{"role": "system", "content": "You are an agent. " * 40},
                                     {"role": "user", "content": f"agent {n} step {i}"}]}
                # Sessions end and new ones start (every few steps): a worker that joins gets new sessions;
                # the cost model keeps a running session where its prefix is cached.
                conv = f"a{n}-{i // 4}"
                seq, self.sent = self.sent, self.sent + 1
                async with h.stream("POST", self.url + "/v1/chat/completions", json=body,
                                    headers={"x-conversation-id": conv}) as r:
                    text = (await r.aread()).decode()
                    ok = r.status_code == 200 and "[DONE]" in text and '"error"' not in text
                    self.seen.append((200 if ok else r.status_code, r.headers.get("x-kvgate-worker", ""), conv, seq))
                i += 1

    def workers(self, since: int = 0) -> set[str]:
        """Workers of the requests sent from number ``since`` on (a request sent before may end after)."""
        return {w for _, w, _, seq in self.seen if seq >= since}

    def conversations_since(self, since: int) -> set[str]:
        return {c for _, _, c, seq in self.seen if seq >= since}

    def stop(self) -> None:
        self._stop.set()


async def test_traffic_follows_the_dns_records(dnsmasq: Dnsmasq, model_dir: Path) -> None:
    fleet = Fleet(model_dir)
    a, b, c = "127.0.0.2", "127.0.0.3", "127.0.0.4"
    for ip in (a, b):
        await fleet.start(ip)
    dnsmasq.write({NAME: [a, b]})
    dnsmasq.reload_hosts()
    settings = GatewaySettings(
        discovery=DnsDiscovery(name=NAME, port=fleet.http, interval_s=0.2, nameservers=[dnsmasq.nameserver],
                               worker=WorkerTemplate(model=MODEL, engine="sim", block_size=128, kv_events="auto")),
        hash_seed="0", tokenizers={MODEL: str(model_dir)}, health_interval_s=0.2)
    gwh = await start_server(create_app(settings))
    gw: Gateway = gwh.server.config.app.state.gateway
    traffic = Traffic(gwh.url)
    agents: list[asyncio.Task[Any]] = []
    try:
        assert {w.id for w in gw.pool.all() if w.healthy} == {fleet.wid(a), fleet.wid(b)}
        assert gw.subscriber.covers(fleet.wid(a)) and gw.subscriber.covers(fleet.wid(b))
        agents = [asyncio.create_task(traffic.agent(n)) for n in range(4)]
        await eventually(lambda: traffic.workers() == {fleet.wid(a), fleet.wid(b)}, timeout_s=10)

        async def homes(since: int = 0) -> set[str | None]:
            convs = sorted(traffic.conversations_since(since))
            return {s.home for s in [await gw.store.peek(ConversationId(c)) for c in convs] if s}

        async def some_home_on_b() -> bool:
            return fleet.wid(b) in await homes()

        await eventually(some_home_on_b, timeout_s=10)
        # b's pod is replaced by c's, which DNS lists before c answers: c is found but gets nothing.
        dnsmasq.write({NAME: [a, c]})
        dnsmasq.reload_hosts()
        await eventually(lambda: fleet.wid(c) in {w.id for w in gw.pool.all()}, timeout_s=5)
        await eventually(lambda: fleet.wid(b) not in {w.id for w in gw.pool.all()}, timeout_s=10)  # drained
        mark = traffic.sent
        await fleet.stop(b)  # the pod goes once kvgate no longer sends it anything
        await asyncio.sleep(0.6)
        assert fleet.wid(c) not in traffic.workers() and not gw.pool.get(fleet.wid(c)).healthy
        await fleet.start(c)
        await eventually(lambda: fleet.wid(c) in traffic.workers(mark), timeout_s=10)
        assert gw.subscriber.covers(fleet.wid(c)) and fleet.wid(b) not in traffic.workers(mark)
        assert gw.prefix.index.block_count(fleet.wid(b)) == 0 and not gw.subscriber.covers(fleet.wid(b))
        assert fleet.wid(b) not in await homes(mark)  # the conversations that went on found a new home
    finally:
        traffic.stop()
        await asyncio.gather(*agents, return_exceptions=True)
        try:
            failed = [s for s in traffic.seen if s[0] != 200]
            assert not failed and len(traffic.seen) > 20, failed
            c_metrics = type("C", (), {"url": gwh.url})()
            assert await metric(c_metrics, "kvgate_retries_total") == 0  # type: ignore[arg-type]
            assert await metric(c_metrics, "kvgate_upstream_failures_total") == 0  # type: ignore[arg-type]
        finally:
            await gwh.stop()
            for ip in list(fleet.up):
                await fleet.stop(ip)


async def test_static_workers_stay_and_unreachable_joins_get_no_traffic() -> None:
    from kvgate.clock import MonotonicClock
    from kvgate.config import WorkerConfig
    from kvgate.discovery import StaticSource
    from kvgate.gateway.kvevents import KvEventSubscriber
    from kvgate.gateway.membership import Membership
    from kvgate.gateway.prefix import PrefixKnowledge
    from kvgate.gateway.workers import WorkerPool

    static = WorkerConfig(url=f"http://127.0.0.1:{free_port()}", model="m")
    found = WorkerConfig(url=f"http://127.0.0.1:{free_port()}", model="m")  # nothing listens there
    async with httpx.AsyncClient() as client:
        pool = WorkerPool([static], client, MonotonicClock())
        prefix = PrefixKnowledge(pool.spec, pool.specs, 60.0)
        sub = KvEventSubscriber(prefix.events, [], client)
        m = Membership(pool, sub, prefix, StaticSource([]))
        await m.apply([found])
        w = pool.get(WorkerId(found.id))
        assert w.joining and not w.healthy and pool.snapshot("m").get(w.id) is not None
        await m.apply([found])  # the next round tries again: still not answering
        assert w.joining and m.joined == 1
        await m.apply([])
        assert [x.id for x in pool.all()] == [WorkerId(static.id)] and m.left == 1  # the static one stays
        assert pool.get(WorkerId(found.id)).draining  # still found for late accounting calls
        await sub.stop()
