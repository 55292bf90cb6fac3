"""The ZMQ edge of KV events: one SUB socket per worker feeding ``router.kvevents.KvEventState``, and
a DEALER to the worker's replay socket when a sequence gap shows that batches were lost."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from urllib.parse import urlparse

import httpx
import zmq
import zmq.asyncio

from kvgate.config import WorkerConfig
from kvgate.router.kvevents import KvEventState
from kvgate.router.types import WorkerId

log = logging.getLogger(__name__)


def _connectable(endpoint: str, worker_url: str) -> str:
    """vLLM reports its bind address (``tcp://*:5557``); connect to the worker's host instead."""
    host = urlparse(worker_url).hostname or "127.0.0.1"
    return endpoint.replace("*", host).replace("0.0.0.0", host)


class KvEventSubscriber:
    def __init__(self, state: KvEventState, workers: list[WorkerConfig], client: httpx.AsyncClient,
                 replay_timeout_s: float = 2.0) -> None:
        self.state = state
        self._workers = [w for w in workers if w.kv_events]
        self._client = client
        self._ctx = zmq.asyncio.Context()
        self._tasks: list[asyncio.Task[None]] = []
        self._replay_timeout = replay_timeout_s
        self.endpoints: dict[WorkerId, tuple[str, str | None]] = {}

    def covers(self, wid: WorkerId) -> bool:
        return wid in self.endpoints

    async def _resolve(self, w: WorkerConfig) -> tuple[str, str | None] | None:
        if w.kv_events != "auto":
            assert w.kv_events is not None
            return w.kv_events, w.kv_replay
        try:
            r = await self._client.get(f"{w.url}/kv_event_sources", timeout=5.0)
            data = r.json()
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

    async def start(self) -> None:
        for w in self._workers:
            ep = await self._resolve(w)
            if ep is None:
                continue
            wid = WorkerId(w.id)
            self.endpoints[wid] = ep
            self.state.add_worker(wid)
            self._tasks.append(asyncio.get_running_loop().create_task(self._run(wid, *ep), name=f"kv-{wid}"))

    async def _run(self, wid: WorkerId, endpoint: str, replay: str | None) -> None:
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        try:
            while True:
                frames = await sock.recv_multipart()
                if len(frames) < 3 or len(frames[-2]) != 8:
                    self.state.stats.malformed += 1
                    continue
                seq = int.from_bytes(frames[-2], "big", signed=True)
                try:
                    gap_from = self.state.on_message(wid, seq, frames[-1])
                    if gap_from is not None:
                        await self._replay(wid, replay, gap_from)
                except Exception:  # one bad batch must not stop this worker's stream for good
                    log.exception("worker %s: KV event handling failed; dropping its index", wid)
                    self.state.on_replay_failed(wid)
        finally:
            sock.close(0)

    async def _replay(self, wid: WorkerId, endpoint: str | None, start: int) -> None:
        if endpoint is None:
            log.warning("worker %s: KV event gap at seq %d and no replay endpoint: dropping its index", wid, start)
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
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._ctx.term()
