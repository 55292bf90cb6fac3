"""Where workers come from, behind one small interface (``WorkerSource``): the static list, DNS (a
headless Service's A/AAAA or SRV records, re-resolved) and the Kubernetes API (EndpointSlices or Pods,
watched). A source yields the whole current set of workers whenever it may have changed; the gateway's
``Membership`` turns the differences into joins and leaves.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any, Protocol

from kvgate.config import DnsDiscovery, KubernetesDiscovery, WorkerConfig, WorkerTemplate


class WorkerSource(Protocol):
    def watch(self) -> AsyncIterator[list[WorkerConfig]]:
        """Each item: every worker the source knows now. Errors are the source's to survive: a source
        that cannot tell (DNS timeout, API server down) yields nothing rather than an empty set."""
        ...


class StaticSource:
    def __init__(self, workers: Sequence[WorkerConfig]) -> None:
        self._workers = list(workers)

    async def watch(self) -> AsyncIterator[list[WorkerConfig]]:
        yield list(self._workers)
        await asyncio.Event().wait()  # a static list never changes


def worker_at(template: WorkerTemplate, host: str, port: int, overrides: Mapping[str, Any] | None = None
              ) -> WorkerConfig:
    """The worker at ``host:port`` with the template's settings (``{host}`` in a KV-event endpoint is the
    address found) and per-worker ``overrides``."""
    fields = template.model_dump()
    fields.update({k: v for k, v in (overrides or {}).items() if v is not None})
    addr = f"[{host}]" if ":" in host else host
    for key in ("kv_events", "kv_replay"):
        if isinstance(fields.get(key), str):
            fields[key] = fields[key].replace("{host}", addr)
    return WorkerConfig(url=f"http://{addr}:{port}", **fields)


def make_source(cfg: DnsDiscovery | KubernetesDiscovery) -> WorkerSource:
    if isinstance(cfg, DnsDiscovery):
        from kvgate.discovery.dns import DnsSource

        return DnsSource(cfg)
    from kvgate.discovery.kubernetes import KubernetesSource

    return KubernetesSource(cfg)
