"""The ZMQ edge of KV events: one SUB socket per worker feeding ``router.kvevents.KvEventState``, a
DEALER to the worker's replay socket, and a socket monitor on the SUB socket.

The monitor is what sees the event connection itself: ``EVENT_DISCONNECTED`` (the publisher's process
died or the network dropped) marks the worker's index stale at once, and every ``EVENT_CONNECTED`` —
the first one at subscribe, the next ones after a reconnect — starts the stream over from the
publisher's buffer (a warm replay), so a gateway that starts, or a worker that restarts, is known
again without waiting for new traffic. The health poll asks for the same resync when it sees a
worker restart (``request_resync``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from urllib.parse import urlparse

import httpx
import zmq
import zmq.asyncio
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector
from zmq.utils.monitor import parse_monitor_message

from kvgate.config import WorkerConfig
from kvgate.router.kvevents import KvEventState
from kvgate.router.types import WorkerId
from kvgate.tasks import cancel_and_wait, stopping

log = logging.getLogger(__name__)

_POLL_MS = 200
"""How often a quiet stream looks for a resync the health poll asked for."""

_RETRY_S = (0.5, 5.0)
"""``kv_events: auto`` on a worker not answering yet: first and longest wait between attempts to ask it.
The ask is one small GET, so the cap is short: with 30 s a worker that came up was routed in approximate
mode for up to 30 s after its first good health check."""


class _NotUp(Exception):
    """The worker could not be asked where it publishes (not started yet, or down): ask again later."""


class SubscriberCollector(Collector):
    """Event-stream figures beside ``telemetry.PrefixCollector``'s: resyncs, skipped copies, disconnects."""

    def __init__(self, sub: KvEventSubscriber) -> None:
        self._sub = sub

    def collect(self) -> Iterator[Metric]:
        st = self._sub.state.stats
        for name, doc, value in (
            ("kvgate_kv_event_resyncs", "Event streams started over from the publisher's buffer (subscribe, "
             "reconnect, worker restart).", st.resyncs),
            ("kvgate_kv_event_duplicates", "Live event batches skipped because a replay had applied them.",
             st.duplicates),
            ("kvgate_kv_event_disconnects", "KV event connections that dropped (the worker's index went stale).",
             self._sub.disconnects),
        ):
            c = CounterMetricFamily(name, doc)
            c.add_metric([], value)
            yield c


def _connectable(endpoint: str, worker_url: str) -> str:
    """vLLM reports its bind address (``tcp://*:5557``); connect to the worker's host instead."""
    host = urlparse(worker_url).hostname or "127.0.0.1"
    return endpoint.replace("*", host).replace("0.0.0.0", host)


class KvEventSubscriber:
    def __init__(self, state: KvEventState, workers: list[WorkerConfig], client: httpx.AsyncClient,
                 replay_timeout_s: float = 2.0, warm_start: bool = True) -> None:
        self.state = state
        self.warm_start = warm_start
        """Replay each publisher's buffer at subscribe (off: wait for the worker's next event, then replay
        what its buffer holds — kvgate before warm starts, kept for the restart benchmark)."""
        self._synced: dict[WorkerId, asyncio.Event] = {}
        self._workers = [w for w in workers if w.kv_events]
        self._client = client
        self._ctx = zmq.asyncio.Context()
        self._tasks: dict[WorkerId, asyncio.Task[None]] = {}
        self._replay_timeout = replay_timeout_s
        self._resync_wanted: set[WorkerId] = set()
        self.endpoints: dict[WorkerId, tuple[str, str | None]] = {}
        self.disconnects = 0

    def covers(self, wid: WorkerId) -> bool:
        return wid in self.endpoints

    def request_resync(self, wid: WorkerId) -> None:
        """Start the worker's stream over at the next chance (its entries are dropped, then replayed)."""
        if wid in self._tasks:
            self._resync_wanted.add(wid)

    async def _resolve(self, w: WorkerConfig) -> tuple[str, str | None] | None:
        if w.kv_events != "auto":
            assert w.kv_events is not None
            return w.kv_events, w.kv_replay
        if w.engine == "sglang":
            return await self._sglang_endpoints(w)
        try:
            r = await self._client.get(f"{w.url}/kv_event_sources", timeout=5.0)
            data = r.json()
        except httpx.TransportError as exc:
            raise _NotUp(repr(exc)) from None
        except (httpx.HTTPError, ValueError) as exc:
            log.warning("worker %s: no /kv_event_sources (%r); routing it in approximate mode", w.id, exc)
            return None
        # kvgate's simulator answers {"endpoint", "replay_endpoint"}; vLLM (--enable-scale-out) {"0": cfg}.
        cfg = data.get("0", data) if isinstance(data, dict) else None
        if not isinstance(cfg, dict) or not cfg.get("endpoint"):
            log.warning("worker %s publishes no KV events; approximate mode", w.id)
            return None
        replay = cfg.get("replay_endpoint")
        return _connectable(cfg["endpoint"], w.url), _connectable(replay, w.url) if replay else None

    async def _sglang_endpoints(self, w: WorkerConfig) -> tuple[str, str | None] | None:
        """SGLang describes its publisher in ``/server_info`` → ``kv_events``: ports counted from a base per
        data-parallel rank (kvgate follows rank 0), on the worker's host unless it names one."""
        try:
            r = await self._client.get(f"{w.url}/server_info", timeout=5.0)
            kv = r.json().get("kv_events") if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError, AttributeError) as exc:
            log.warning("worker %s: no /server_info (%r); routing it in approximate mode", w.id, exc)
            return None
        if not isinstance(kv, dict) or not isinstance(kv.get("endpoint_port_base"), int):
            log.warning("worker %s publishes no KV events; approximate mode", w.id)
            return None
        host = kv.get("endpoint_host") or "*"
        replay = kv.get("replay_endpoint_port_base")
        return (_connectable(f"tcp://{host}:{kv['endpoint_port_base']}", w.url),
                _connectable(f"tcp://{host}:{replay}", w.url) if isinstance(replay, int) else None)

    async def start(self) -> None:
        for w in self._workers:
            await self.subscribe(w)

    async def subscribe(self, w: WorkerConfig) -> bool:
        """Follow the worker's events (True), or leave it to approximate mode (False)."""
        if not w.kv_events:
            return False
        wid = WorkerId(w.id)
        if wid in self._tasks:  # followed already, or asking again
            return False
        try:
            ep = await self._resolve(w)
        except _NotUp as exc:
            # Workers started with the gateway (a pasted recipe, a compose stack, pods) are often not up
            # yet: approximate mode until the worker answers, then its events, instead of never.
            log.info("worker %s not answering yet (%s); asking for its KV events again", w.id, exc)
            self._tasks[wid] = asyncio.get_running_loop().create_task(self._resolve_later(w), name=f"kv-{wid}")
            return False
        if ep is None:
            return False
        self._follow(wid, ep)
        return True

    async def _resolve_later(self, w: WorkerConfig) -> None:
        wait = _RETRY_S[0]
        # httpx can turn a cancel that arrives mid-connect into ConnectError (_NotUp here): the loop
        # would ask on for ever if it did not check that it was told to stop.
        while not stopping():
            await asyncio.sleep(wait)
            wait = min(_RETRY_S[1], wait * 2)
            try:
                ep = await self._resolve(w)
            except _NotUp:
                continue
            if ep is not None and not stopping():  # an answer that raced the stop must not start a stream
                log.info("worker %s: following its KV events at %s", w.id, ep[0])
                self._tasks.pop(WorkerId(w.id), None)
                self._follow(WorkerId(w.id), ep)
            return

    def _follow(self, wid: WorkerId, ep: tuple[str, str | None]) -> None:
        self.endpoints[wid] = ep
        self.state.add_worker(wid)
        self._synced[wid] = asyncio.Event()
        self._tasks[wid] = asyncio.get_running_loop().create_task(self._run(wid, *ep), name=f"kv-{wid}")

    async def wait_synced(self, timeout_s: float) -> bool:
        """Wait (at most ``timeout_s``) until every subscribed worker's first replay is done, so a gateway
        that starts routes its first requests knowing the workers' caches. False on timeout."""
        pending = [e.wait() for e in self._synced.values() if not e.is_set()]
        if not pending:
            return True
        try:
            await asyncio.wait_for(asyncio.gather(*pending), timeout_s)
            return True
        except TimeoutError:
            log.warning("KV event streams not all replayed after %.1fs; routing starts anyway", timeout_s)
            return False

    async def unsubscribe(self, wid: WorkerId) -> None:
        self._synced.pop(wid, None)
        task = self._tasks.pop(wid, None)
        self.endpoints.pop(wid, None)
        self._resync_wanted.discard(wid)
        await cancel_and_wait(task)
        self.state.remove_worker(wid)

    async def _run(self, wid: WorkerId, endpoint: str, replay: str | None) -> None:
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        mon = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        sock.connect(endpoint)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        poller = zmq.asyncio.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(mon, zmq.POLLIN)
        try:
            while not stopping():  # a replay's awaits may swallow a cancel (caught as a failed replay)
                ready = dict(await poller.poll(_POLL_MS))
                resync = False
                if mon in ready:
                    resync = self._on_monitor(wid, await mon.recv_multipart())
                if resync or wid in self._resync_wanted:
                    self._resync_wanted.discard(wid)
                    start = self.state.resync(wid)
                    if start is not None:
                        await self._replay(wid, replay, start)
                    self._synced[wid].set()
                    continue
                if sock in ready:
                    await self._on_frames(wid, replay, await sock.recv_multipart())
        finally:
            sock.disable_monitor()
            mon.close(0)
            sock.close(0)

    def _on_monitor(self, wid: WorkerId, frames: list[bytes]) -> bool:
        """A connection event; True when the stream must start over."""
        event = parse_monitor_message(frames)["event"]
        if event == zmq.EVENT_DISCONNECTED:
            log.warning("worker %s: KV event connection lost; its index is stale until it is back", wid)
            self.disconnects += 1
            self.state.mark_stale(wid)
            return False
        if event != zmq.EVENT_CONNECTED:
            return False
        if not self.warm_start and not self._synced[wid].is_set():
            self._synced[wid].set()
            return False
        return True

    async def _on_frames(self, wid: WorkerId, replay: str | None, frames: list[bytes]) -> None:
        if len(frames) < 3 or len(frames[-2]) != 8:
            self.state.stats.malformed += 1
            return
        seq = int.from_bytes(frames[-2], "big", signed=True)
        try:
            gap_from = self.state.on_message(wid, seq, frames[-1])
            if gap_from is not None:
                await self._replay(wid, replay, gap_from)
        except Exception:  # one bad batch must not stop this worker's stream for good
            log.exception("worker %s: KV event handling failed; dropping its index", wid)
            self.state.on_replay_failed(wid)

    async def _replay(self, wid: WorkerId, endpoint: str | None, start: int) -> None:
        if endpoint is None:
            log.warning("worker %s: KV events from seq %d are missing and there is no replay endpoint: "
                        "dropping its index", wid, start)
            self.state.on_replay_failed(wid)
            return
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        got: list[tuple[int, bytes]] = []
        try:
            await sock.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                if not await sock.poll(int(self._replay_timeout * 1000)):
                    raise TimeoutError("replay timed out")
                frames = await sock.recv_multipart()
                if len(frames) < 2 or len(frames[-2]) != 8:
                    raise TimeoutError("malformed replay frame")
                seq = int.from_bytes(frames[-2], "big", signed=True)
                if seq == -1:
                    break
                got.append((seq, frames[-1]))
            self.state.on_replayed(wid, got)
            log.info("worker %s: replayed %d KV event batches from seq %d", wid, len(got), start)
        except (TimeoutError, zmq.ZMQError) as exc:
            log.warning("worker %s: KV event replay failed (%s): dropping its index", wid, exc)
            self.state.on_replay_failed(wid)
        finally:
            sock.close(0)

    async def stop(self) -> None:
        tasks = list(self._tasks.values())
        self._tasks.clear()
        await asyncio.gather(*(cancel_and_wait(t) for t in tasks))
        self._ctx.term()
