"""TierKeeper's timers and reservations, and BackgroundPrefill's settling, without HTTP: nothing they
park may outlive its wait."""

from __future__ import annotations

import asyncio

import httpx

from kvgate.clock import MonotonicClock
from kvgate.config import GatewaySettings, WorkerConfig
from kvgate.gateway.background_prefill import BackgroundPrefill
from kvgate.gateway.lifecycle import Event, Lifecycle, State
from kvgate.gateway.telemetry import GatewayMetrics
from kvgate.gateway.tiering import TierKeeper
from kvgate.gateway.workers import WorkerPool
from kvgate.router.types import WorkerId

W = WorkerId("w0")


async def keeper(**kw: object) -> tuple[TierKeeper, WorkerPool, httpx.AsyncClient]:
    settings = GatewaySettings(workers=[WorkerConfig(url="http://127.0.0.1:9", model="m", id="w0")], **kw)  # type: ignore[arg-type]
    client = httpx.AsyncClient()
    clock = MonotonicClock()
    pool = WorkerPool(settings.workers, client, clock)
    return TierKeeper(settings, pool, client, clock, GatewayMetrics()), pool, client


async def test_a_reservation_lapses_even_when_a_parallel_branch_answers() -> None:
    k, pool, client = await keeper(waits={"tool_priors_s": {"t": 0.05}, "deadline_factor": 2.0},
                                   prefill={"enabled": True})
    try:
        gen = Lifecycle().on(Event.REQUEST, 0).on(Event.REQUEST, 0)  # two branches in flight
        life = k.completed("c", "x", "m", gen, W, ("t",), 4000)
        assert pool.get(W).reserved == 4000 and life.state is State.GENERATING
        k.completed("c", "x", "m", life, W, (), 100)  # the other branch answers: a settle timer starts
        await asyncio.sleep(0.3)
        assert pool.get(W).reserved == 0
    finally:
        await k.aclose()
        await client.aclose()


async def test_a_retried_request_feeds_its_wait_back_once() -> None:
    k, _pool, client = await keeper(waits={"tool_priors_s": {"t": 30.0}})
    try:
        life = k.completed("c", "x", "m", Lifecycle().on(Event.REQUEST, 0), W, ("t",), 10)
        assert life.state is State.AWAITING_TOOL
        k.arrived("c", "x", life)  # this attempt fails: the stored state stays
        k.arrived("c", "x", life)  # the client retries
        assert k.predictor.observed == 1
    finally:
        await k.aclose()
        await client.aclose()


async def test_answers_without_a_next_turn_count_as_ends_after_settle_s() -> None:
    t = [1000.0]
    settings = GatewaySettings(workers=[WorkerConfig(url="http://127.0.0.1:9", model="m", id="w0")],
                               prefill={"enabled": True, "settle_s": 10.0})
    client = httpx.AsyncClient()
    pool = WorkerPool(settings.workers, client, MonotonicClock())
    k = BackgroundPrefill(settings, pool, client, GatewayMetrics(), wall=lambda: t[0])
    try:
        chain, prefix = list(range(3000)), list(range(100)) + list(range(5000, 7900))
        for cid in ("a", "b"):
            assert k.after_answer(cid, "x", "m", W, tuple(chain), prefix, 16, 0.1) == "unlikely_to_continue"
        t[0] += 5
        k.arrived("a", "x", next_user_turn=True)  # a came back in time
        t[0] += 20
        snap = k.snapshot()  # b did not: an end, swept on the next look
        assert snap["continuation"] == {"x": [1, 1]}
    finally:
        await k.aclose()
        await client.aclose()
