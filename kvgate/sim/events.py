"""KV events on ZMQ in vLLM's or SGLang's wire format (the same framing; the events differ, see
``kinds.py``).

PUB frames ``[topic, seq (8 bytes big-endian), msgpack([ts, [event, ...], dp_rank])]``; each event
a map tagged by ``"type"`` (vLLM ≥ 0.26), block hashes as the digest's low 64 bits. A ROUTER replay
socket answers ``[b"", start_seq]`` with every buffered batch from ``start_seq`` on, then
``seq = -1`` and an empty payload.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

from kvgate.sim.blockpool import KVEvent
from kvgate.sim.kinds import VLLM, EngineKind, encode_vllm_event
from kvgate.sim.kinds import encode_batch as encode_kind_batch

log = logging.getLogger(__name__)


def encode_event(ev: KVEvent) -> dict[str, Any]:
    return encode_vllm_event(ev)


def encode_batch(events: list[KVEvent], ts: float, kind: EngineKind = VLLM) -> bytes:
    return encode_kind_batch(kind, events, ts)


class KVEventPublisher:
    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "",
                 buffer_steps: int = 10_000, wall: Callable[[], float] = time.time,
                 kind: EngineKind = VLLM) -> None:
        self._kind = kind
        self._ctx = zmq.asyncio.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(endpoint)
        self._replay: zmq.asyncio.Socket | None = None
        if replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(replay_endpoint)
        self._topic = topic.encode()
        self._seq = itertools.count()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._wall = wall
        self._task: asyncio.Task[None] | None = None
        self.published = 0

    def start(self) -> None:
        if self._replay is not None and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._serve_replay(), name="kv-replay")

    def publish(self, events: list[KVEvent]) -> None:
        if not events:
            return
        seq = next(self._seq)
        payload = encode_kind_batch(self._kind, events, self._wall())
        self._buffer.append((seq, payload))
        # PUB never blocks: a slow subscriber loses messages and must replay.
        self._pub.send_multipart([self._topic, seq.to_bytes(8, "big"), payload], flags=zmq.NOBLOCK)
        self.published += 1

    async def _serve_replay(self) -> None:
        assert self._replay is not None
        while True:
            frames = await self._replay.recv_multipart()
            if len(frames) != 3:
                continue
            ident, _, start_b = frames
            start = int.from_bytes(start_b, "big")
            # SGLang's replies repeat the topic frame; vLLM's carry only seq and payload.
            head = [ident, b"", self._topic] if self._kind.replay_repeats_topic else [ident, b""]
            for seq, payload in list(self._buffer):
                if seq >= start:
                    await self._replay.send_multipart([*head, seq.to_bytes(8, "big"), payload])
            end = [ident, b"", b""] if self._kind.replay_repeats_topic else [ident, b""]
            await self._replay.send_multipart([*end, (-1).to_bytes(8, "big", signed=True), b""])

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._pub.close(0)
        if self._replay is not None:
            self._replay.close(0)
        self._ctx.term()
