"""Workers named as the endpoint picker protocol names them: ``<ip:port>`` (``[v6]:port``)."""

from __future__ import annotations

from collections.abc import Iterable
from urllib.parse import urlparse

from kvgate.config import WorkerConfig
from kvgate.router.types import WorkerId


def endpoint_of(config: WorkerConfig) -> str:
    """The worker's ``host:port`` as Envoy's override-host load balancing expects it (an IP address in
    an InferencePool, where kvgate discovers the pool's pods)."""
    u = urlparse(config.url)
    host = u.hostname or ""
    port = u.port or (443 if u.scheme == "https" else 80)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def outside(subset: Iterable[str] | None, workers: Iterable[WorkerConfig]) -> set[WorkerId]:
    """The workers a request may not use when Envoy names an endpoint subset (None: no subset given)."""
    if subset is None:
        return set()
    allowed = {s.strip() for s in subset}
    return {WorkerId(w.id) for w in workers if endpoint_of(w) not in allowed}
