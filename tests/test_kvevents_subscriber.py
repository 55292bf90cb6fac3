"""The KV event subscriber's loops stop when asked, even when what they await swallowed the cancellation
(as httpx does to a cancel that arrives mid-connect; see kvgate/tasks.py)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from kvgate.config import WorkerConfig
from kvgate.gateway import kvevents as gw_kvevents
from kvgate.gateway.kvevents import KvEventSubscriber, _NotUp
from kvgate.router.index import PrefixIndex
from kvgate.router.kvevents import KvEventState
from kvgate.router.types import WorkerId
from kvgate.serving import free_port


async def _once_cancelled(task: asyncio.Task[None]) -> None:
    task.cancel()  # once, as asyncio.Runner does when it closes its loop
    done, _ = await asyncio.wait({task}, timeout=2)
    assert done, "the loop ran on after its cancel was swallowed"


async def test_the_retry_loop_stops_after_a_swallowed_cancel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gw_kvevents, "_RETRY_S", (0.01, 0.01))
    w = WorkerConfig(url=f"http://127.0.0.1:{free_port()}", model="m", kv_events="auto")
    asking = asyncio.Event()

    async def resolve(_: WorkerConfig) -> tuple[str, str | None] | None:
        if not asking.is_set():
            asking.set()
            raise _NotUp("not up yet")  # at subscribe: the retry loop takes over
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            raise _NotUp("ConnectError('All connection attempts failed')") from None
        return None

    async with httpx.AsyncClient() as client:
        sub = KvEventSubscriber(KvEventState(PrefixIndex()), [w], client)
        monkeypatch.setattr(sub, "_resolve", resolve)
        assert not await sub.subscribe(w)
        task = sub._tasks[WorkerId(w.id)]
        await asyncio.sleep(0.05)  # into the second ask
        await _once_cancelled(task)
        await asyncio.wait_for(sub.stop(), 5)


async def test_the_stream_loop_stops_after_a_replay_swallowed_its_cancel(monkeypatch: pytest.MonkeyPatch) -> None:
    w = WorkerConfig(url="http://127.0.0.1:1", model="m", kv_events=f"tcp://127.0.0.1:{free_port()}",
                     kv_replay=f"tcp://127.0.0.1:{free_port()}")
    replaying = asyncio.Event()

    async def replay(wid: WorkerId, endpoint: str | None, start: int) -> None:
        replaying.set()
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            pass  # the replay's client made it a failed replay

    async with httpx.AsyncClient() as client:
        sub = KvEventSubscriber(KvEventState(PrefixIndex()), [w], client)
        monkeypatch.setattr(sub, "_replay", replay)
        assert await sub.subscribe(w)
        wid = WorkerId(w.id)
        sub.request_resync(wid)  # nothing publishes there: the resync is what starts a replay
        await asyncio.wait_for(replaying.wait(), 5)
        await _once_cancelled(sub._tasks[wid])
        await asyncio.wait_for(sub.stop(), 5)


async def test_unsubscribe_and_stop_end_their_loops() -> None:
    ws = [WorkerConfig(url="http://127.0.0.1:1", model="m", id=f"w{i}", kv_events=f"tcp://127.0.0.1:{free_port()}")
          for i in range(2)]
    async with httpx.AsyncClient() as client:
        sub = KvEventSubscriber(KvEventState(PrefixIndex()), ws, client)
        await sub.start()
        tasks = dict(sub._tasks)
        await asyncio.wait_for(sub.unsubscribe(WorkerId("w0")), 5)
        assert tasks[WorkerId("w0")].done() and not sub.state.follows(WorkerId("w0"))
        await asyncio.wait_for(sub.stop(), 5)
        assert all(t.done() for t in tasks.values())
