"""DNS discovery against a real DNS server (dnsmasq on loopback)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvgate.config import DnsDiscovery, WorkerTemplate
from kvgate.discovery.dns import DnsSource
from tests.dnsmasq import DOMAIN, Dnsmasq


@pytest.fixture
def dnsmasq(tmp_path: Path) -> Iterator[Dnsmasq]:
    d = Dnsmasq(tmp_path)
    d.write({})
    d.start()
    yield d
    d.stop()


def source(d: Dnsmasq, **kw: object) -> DnsSource:
    return DnsSource(DnsDiscovery(name=f"workers.{DOMAIN}", nameservers=[d.nameserver], timeout_s=1.0,
                                  worker=WorkerTemplate(model="m", engine="sim", kv_events="tcp://{host}:5557"),
                                  **kw))  # type: ignore[arg-type]


async def test_a_and_aaaa_records_become_workers_on_the_configured_port(dnsmasq: Dnsmasq) -> None:
    dnsmasq.write({f"workers.{DOMAIN}": ["127.0.0.2", "127.0.0.3", "::2"]})
    dnsmasq.reload_hosts()
    got = await source(dnsmasq, port=8100).resolve()
    assert [w.url for w in got] == ["http://127.0.0.2:8100", "http://127.0.0.3:8100", "http://[::2]:8100"]
    assert got[0].kv_events == "tcp://127.0.0.2:5557" and got[2].kv_events == "tcp://[::2]:5557"
    assert {w.model for w in got} == {"m"}
    # The Service lost its last ready pod: an answer with no records is an empty fleet.
    dnsmasq.write({})
    dnsmasq.reload_hosts()
    assert await source(dnsmasq).resolve() == []


async def test_srv_records_give_each_worker_its_port(tmp_path: Path) -> None:
    d = Dnsmasq(tmp_path)
    d.write({f"w1.{DOMAIN}": ["127.0.0.2"], f"w2.{DOMAIN}": ["127.0.0.3"]},
            srv=[(f"_http._tcp.workers.{DOMAIN}", f"w1.{DOMAIN}", 8001), (f"_http._tcp.workers.{DOMAIN}",
                                                                         f"w2.{DOMAIN}", 8002)])
    d.start()
    try:
        src = DnsSource(DnsDiscovery(name=f"_http._tcp.workers.{DOMAIN}", record="SRV", nameservers=[d.nameserver],
                                     worker=WorkerTemplate(model="m")))
        assert [w.url for w in await src.resolve()] == ["http://127.0.0.2:8001", "http://127.0.0.3:8002"]
    finally:
        d.stop()


async def test_a_dns_outage_keeps_the_workers_instead_of_emptying_the_fleet(dnsmasq: Dnsmasq) -> None:
    dnsmasq.write({f"workers.{DOMAIN}": ["127.0.0.2"]})
    dnsmasq.reload_hosts()
    src = source(dnsmasq, interval_s=0.05)
    it = src.watch()
    assert [w.url for w in await anext(it)] == ["http://127.0.0.2:8000"]
    dnsmasq.stop()  # nothing answers any more
    import asyncio

    with pytest.raises(TimeoutError):
        await asyncio.wait_for(anext(it), 2.5)  # no empty set is reported
    assert src.failures >= 1
    await it.aclose()
