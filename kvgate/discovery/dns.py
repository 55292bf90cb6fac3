"""DNS discovery: a headless Service's records, re-resolved every ``interval_s``.

dnspython rather than the system's ``getaddrinfo``: it is the maintained DNS library for Python, it
resolves SRV records (a port per worker), queries without blocking the event loop
(``dns.asyncresolver``), can be pointed at a given nameserver and port, and tells "the name has no
records" (the Service has no ready pod: every worker leaves) apart from "the resolver did not answer"
(keep the workers kvgate has: a DNS outage must not empty the fleet).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import dns.asyncresolver
import dns.exception
import dns.nameserver
import dns.resolver

from kvgate.config import DnsDiscovery, WorkerConfig
from kvgate.discovery import worker_at

log = logging.getLogger(__name__)

_NO_RECORDS = (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer)


def _resolver(cfg: DnsDiscovery) -> dns.asyncresolver.Resolver:
    r = dns.asyncresolver.Resolver(configure=not cfg.nameservers)
    if cfg.nameservers:
        servers: list[str | dns.nameserver.Nameserver] = []
        for ns in cfg.nameservers:
            host, _, port = ns.rpartition(":") if ns.count(":") == 1 else (ns, "", "")
            servers.append(dns.nameserver.Do53Nameserver(host, int(port) if port else 53))
        r.nameservers = servers
    r.lifetime = cfg.timeout_s
    return r


class DnsSource:
    def __init__(self, cfg: DnsDiscovery) -> None:
        self.cfg = cfg
        self._resolver = _resolver(cfg)
        self.failures = 0

    async def _addresses(self, name: str) -> list[str]:
        out: list[str] = []
        for rdtype in ("A", "AAAA"):
            try:
                answer = await self._resolver.resolve(name, rdtype)
            except _NO_RECORDS:
                continue
            out.extend(r.to_text() for r in answer)
        return out

    async def resolve(self) -> list[WorkerConfig]:
        """The workers the records name now; raises ``dns.exception.DNSException`` when DNS did not answer."""
        cfg = self.cfg
        if cfg.record == "A":
            targets = [(host, cfg.port) for host in await self._addresses(cfg.name)]
        else:
            try:
                srv = await self._resolver.resolve(cfg.name, "SRV")
            except _NO_RECORDS:
                srv = None
            targets = []
            for rec in srv or []:
                for host in await self._addresses(rec.target.to_text()):
                    targets.append((host, int(rec.port)))
        return [worker_at(cfg.worker, host, port) for host, port in sorted(set(targets))]

    async def watch(self) -> AsyncIterator[list[WorkerConfig]]:
        while True:
            try:
                yield await self.resolve()
            except dns.exception.DNSException as exc:
                self.failures += 1
                log.warning("DNS discovery of %s failed (%r); keeping the workers kvgate has", self.cfg.name, exc)
            await asyncio.sleep(self.cfg.interval_s)
