"""Kubernetes discovery: EndpointSlices (or Pods) by label selector, listed, watched, relisted every
``resync_s``. Thin on purpose (no API server can run where kvgate is tested): ``workers_from_slices`` and
``workers_from_pods`` translate API objects into worker configs and ``apply_event`` keeps the listed set
current — those are unit-tested on objects built with the client's own models; the list/watch loop
around them is not.

The client is the official ``kubernetes`` package, maintained by the Kubernetes project: typed models for
every API object, in-cluster configuration from the ServiceAccount, resourceVersion-based watches, and
(since v37) an asyncio client in the same package (``kubernetes.aio``), so the watch runs on the gateway's
event loop without a thread.

- EndpointSlices: readiness from ``conditions.ready`` (nil means ready, as the API says); terminating
  endpoints are left out (they leave: kvgate drains them); the HTTP port and the KV-event ports are
  the slice's ports named ``port_name``, ``kv_events_port_name``, ``kv_replay_port_name``; model and
  engine from the template (one Service per model).
- Pods: readiness from the ``Ready`` condition; ports are the containers' named ports; annotations
  ``kvgate.io/model``, ``kvgate.io/engine``, ``kvgate.io/kv-events``, ``kvgate.io/kv-replay``,
  ``kvgate.io/block-size``, ``kvgate.io/hash-algo`` override the template.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator, Iterable, MutableMapping
from typing import Any

from pydantic import ValidationError

from kvgate.config import KubernetesDiscovery, WorkerConfig
from kvgate.discovery import worker_at

log = logging.getLogger(__name__)

ANNOTATIONS = {"kvgate.io/model": "model", "kvgate.io/engine": "engine", "kvgate.io/kv-events": "kv_events",
               "kvgate.io/kv-replay": "kv_replay", "kvgate.io/block-size": "block_size",
               "kvgate.io/hash-algo": "hash_algo"}


def _event_ports(cfg: KubernetesDiscovery, ports: dict[str, int], host: str) -> dict[str, str]:
    out = {}
    for field, name in (("kv_events", cfg.kv_events_port_name), ("kv_replay", cfg.kv_replay_port_name)):
        if name and name in ports:
            out[field] = f"tcp://{{host}}:{ports[name]}"
    return out


def _worker(cfg: KubernetesDiscovery, host: str, port: int, overrides: dict[str, Any], what: str
            ) -> WorkerConfig | None:
    try:
        return worker_at(cfg.worker, host, port, overrides)
    except ValidationError as exc:
        log.warning("kubernetes discovery: %s left out: %s", what, exc.errors()[0]["msg"])
        return None


def workers_from_slices(slices: Iterable[Any], cfg: KubernetesDiscovery) -> list[WorkerConfig]:
    out: dict[str, WorkerConfig] = {}
    for s in slices:
        ports = {p.name: p.port for p in s.ports or [] if p.name and p.port}
        http = ports.get(cfg.port_name)
        if http is None:
            continue
        for ep in s.endpoints or []:
            cond = ep.conditions
            if cond is not None and (cond.ready is False or cond.terminating):
                continue
            if not ep.addresses:
                continue
            host = ep.addresses[0]  # the addresses of one endpoint are fungible
            w = _worker(cfg, host, http, _event_ports(cfg, ports, host), f"endpoint {host}")
            if w is not None:
                out[w.id] = w
    return sorted(out.values(), key=lambda w: w.id)


def workers_from_pods(pods: Iterable[Any], cfg: KubernetesDiscovery) -> list[WorkerConfig]:
    out: dict[str, WorkerConfig] = {}
    for p in pods:
        status, meta = p.status, p.metadata
        if meta.deletion_timestamp is not None or status is None or not status.pod_ip:
            continue
        if not any(c.type == "Ready" and c.status == "True" for c in status.conditions or []):
            continue
        ports = {port.name: port.container_port for c in p.spec.containers for port in c.ports or [] if port.name}
        http = ports.get(cfg.port_name)
        if http is None:
            continue
        overrides: dict[str, Any] = _event_ports(cfg, ports, status.pod_ip)
        ann = meta.annotations or {}
        overrides.update({field: ann[key] for key, field in ANNOTATIONS.items() if key in ann})
        w = _worker(cfg, status.pod_ip, http, overrides, f"pod {meta.name}")
        if w is not None:
            out[w.id] = w
    return sorted(out.values(), key=lambda w: w.id)


def apply_event(objects: MutableMapping[str, Any], kind: str, obj: Any) -> bool:
    """Keep the listed objects current with one watch event (keyed by namespace/name). False for an
    ``ERROR`` event (e.g. 410 Gone: the resourceVersion is too old): the caller relists."""
    if kind == "ERROR":
        return False
    key = f"{obj.metadata.namespace}/{obj.metadata.name}"
    if kind == "DELETED":
        objects.pop(key, None)
    elif kind in ("ADDED", "MODIFIED"):
        objects[key] = obj
    return True


class KubernetesSource:
    def __init__(self, cfg: KubernetesDiscovery) -> None:
        self.cfg = cfg
        self.failures = 0

    def translate(self, objects: Iterable[Any]) -> list[WorkerConfig]:
        if self.cfg.resource == "pods":
            return workers_from_pods(objects, self.cfg)
        return workers_from_slices(objects, self.cfg)

    async def watch(self) -> AsyncIterator[list[WorkerConfig]]:  # pragma: no cover - needs an API server
        from kubernetes.aio import client, config, watch

        # The aio package's config and watch modules are untyped: used through Any.
        cfg_mod: Any = config
        if os.environ.get("KUBERNETES_SERVICE_HOST"):
            cfg_mod.load_incluster_config()
        else:
            await cfg_mod.load_kube_config()
        watch_mod: Any = watch
        async with client.ApiClient() as api_client:
            lister: Any = (client.CoreV1Api(api_client).list_namespaced_pod if self.cfg.resource == "pods"
                           else client.DiscoveryV1Api(api_client).list_namespaced_endpoint_slice)
            while True:
                try:
                    async for workers in self._list_and_watch(lister, watch_mod):
                        yield workers
                except Exception as exc:  # the API server is away: keep the workers kvgate has, retry
                    self.failures += 1
                    log.warning("kubernetes discovery failed (%r); keeping the workers kvgate has", exc)
                    await asyncio.sleep(min(30.0, 2.0 ** min(self.failures, 5)))

    async def _list_and_watch(self, lister: Any, watch_mod: Any
                              ) -> AsyncIterator[list[WorkerConfig]]:  # pragma: no cover - needs an API server
        """One list, then a watch from its resourceVersion until ``resync_s`` ends it (a relist follows)."""
        cfg = self.cfg
        listed: Any = await lister(cfg.namespace, label_selector=cfg.label_selector)
        objects = {f"{o.metadata.namespace}/{o.metadata.name}": o for o in listed.items}
        self.failures = 0
        yield self.translate(objects.values())
        async with watch_mod.Watch() as w:
            async for ev in w.stream(lister, cfg.namespace, label_selector=cfg.label_selector,
                                     resource_version=listed.metadata.resource_version,
                                     timeout_seconds=int(cfg.resync_s)):
                if not apply_event(objects, ev["type"], ev["object"]):
                    return
                yield self.translate(objects.values())
