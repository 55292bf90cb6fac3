"""What the processes of one pod (``kvgate serve --workers N``) answer as one: ``/ready`` and ``/metrics``.

The N processes accept on one listening socket, so a probe or a scrape reaches whichever accepts it.
Answered by that one alone, ``/ready`` would say "ready" while a sibling is still starting, and every
scrape would return another process's counters (to Prometheus, a counter reset at every scrape). So
each process also serves the app on a private Unix socket (``RUN_DIR/INDEX.sock``), and the one that
gets ``/ready`` or ``/metrics`` on the public port asks every sibling there:

- ``/ready``: 200 only when every process answers its own ``/ready`` 200 (all started, none draining);
- ``/metrics``: every process's samples, each with the label ``process="INDEX"`` (INDEX is stable
  across a restart of that process), in one exposition: one target per pod, ``sum without (process)``
  gives the pod's totals. A process that does not answer is left out (and counted in
  ``kvgate_pod_processes_scraped``).

Every response on the public port carries ``x-kvgate-process: INDEX``: which process served it.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import httpx
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample
from starlette.types import ASGIApp, Message, Receive, Scope, Send

PROCESS_LABEL = "process"
SIBLING_TIMEOUT_S = 2.0


def socket_path(run_dir: str, index: int) -> str:
    return str(Path(run_dir) / f"{index}.sock")


def merge_expositions(texts: dict[int, str]) -> list[Metric]:
    """Each process's metric families, samples labelled with the process, one family per name in the
    order first seen (the text format wants a family's samples together)."""
    families: dict[str, Metric] = {}
    for index, text in sorted(texts.items()):
        for fam in text_string_to_metric_families(text):
            merged = families.get(fam.name)
            if merged is None:
                merged = families[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            merged.samples.extend(Sample(s.name, {**s.labels, PROCESS_LABEL: str(index)}, s.value, s.timestamp,
                                         s.exemplar) for s in fam.samples)
    return list(families.values())


class _Families:
    """A collector that yields fixed families, to reuse prometheus_client's exposition writer."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = list(families)

    def collect(self) -> Iterable[Metric]:
        return self._families


def exposition(families: Iterable[Metric]) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(families))
    return generate_latest(registry)


class PidTagged:
    """The app on a process's private socket, its answers tagged with the process id (``/ready`` lists it)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self._header = (b"x-kvgate-pid", str(os.getpid()).encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def tagged(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self._header]}
            await send(message)

        await self.app(scope, receive, tagged)


class PodView:
    """ASGI wrapper of the app on the public port of process ``index`` of ``count``."""

    def __init__(self, app: ASGIApp, index: int, count: int, run_dir: str) -> None:
        self.app = app
        self.index = index
        self.count = count
        self._header = (b"x-kvgate-process", str(index).encode())
        self._clients = {i: httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=socket_path(run_dir, i)),
                                              base_url="http://kvgate", timeout=SIBLING_TIMEOUT_S)
                         for i in range(count)}

    async def aclose(self) -> None:
        for c in self._clients.values():
            await c.aclose()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if scope["method"] == "GET" and scope["path"] == "/ready":
            await self._answer(send, *await self.ready())
            return
        if scope["method"] == "GET" and scope["path"] == "/metrics":
            await self._answer(send, 200, await self.metrics(), CONTENT_TYPE_LATEST)
            return

        async def tagged(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self._header]}
            await send(message)

        await self.app(scope, receive, tagged)

    async def _ask(self, index: int, path: str) -> httpx.Response | None:
        try:
            return await self._clients[index].get(path)
        except httpx.HTTPError:
            return None  # not started yet, restarting, or stuck: not counted as an answer

    async def ready(self) -> tuple[int, bytes, str]:
        answers = await asyncio.gather(*(self._ask(i, "/ready") for i in range(self.count)))
        per = [{"process": i, "pid": int(r.headers.get("x-kvgate-pid", 0)) if r is not None else None,
                "ready": r is not None and r.status_code == 200} for i, r in enumerate(answers)]
        own = answers[self.index]
        body: dict[str, Any] = own.json() if own is not None else {}
        ok = all(p["ready"] for p in per)
        body.update(ready=ok, processes=per)
        return (200 if ok else 503), json.dumps(body).encode(), "application/json"

    async def metrics(self) -> bytes:
        answers = await asyncio.gather(*(self._ask(i, "/metrics") for i in range(self.count)))
        texts = {i: r.text for i, r in enumerate(answers) if r is not None and r.status_code == 200}
        # Parsing a few hundred kB of text is CPU: off the event loop, so requests in flight keep flowing.
        families = await asyncio.to_thread(merge_expositions, texts)
        scraped = GaugeMetricFamily("kvgate_pod_processes_scraped", "Processes of this pod whose metrics this "
                                    "scrape holds, of kvgate_pod_processes.", value=len(texts))
        total = GaugeMetricFamily("kvgate_pod_processes", "Gateway processes in this pod (serve --workers).",
                                  value=self.count)
        return await asyncio.to_thread(exposition, [*families, scraped, total])

    async def _answer(self, send: Send, status: int, body: bytes, content_type: str) -> None:
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", content_type.encode()),
                                (b"content-length", str(len(body)).encode()), self._header]})
        await send({"type": "http.response.body", "body": body})
