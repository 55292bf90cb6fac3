"""A worker's queue as the gateway knows it (router/load.py), and the one accounting shared by the gateway's
pool and the virtual-time fleets."""

from __future__ import annotations

import httpx
import pytest

from kvgate.clock import MonotonicClock
from kvgate.config import WorkerConfig
from kvgate.gateway.workers import WorkerPool
from kvgate.router.load import SERVICE_EWMA, WorkerLoad
from kvgate.router.types import WorkerId
from kvgate.sim.fleetcore import Accounting


def queue(w: WorkerLoad) -> tuple[int, int, int, int, int]:
    return w.in_flight, w.pending_prefill, w.pending_requests, w.decode_requests, w.decode_tokens


def test_a_request_is_pending_until_its_first_token_then_decoding_until_it_ends() -> None:
    w = WorkerLoad()
    w.acquire(300)
    w.acquire(50)
    assert queue(w) == (2, 350, 2, 0, 0)
    w.first_token(300, 1000)
    assert queue(w) == (2, 50, 1, 1, 1000)
    w.release(300, 1000, got_first_token=True)
    assert queue(w) == (1, 50, 1, 0, 0)
    w.release(50)  # ended before its first token (refused, lost, the client gone): its prefill goes back
    assert queue(w) == (0, 0, 0, 0, 0)


def test_service_time_is_a_moving_average_of_completed_requests_only() -> None:
    w = WorkerLoad()
    w.acquire()
    w.release(held_s=None)
    assert w.service_s is None
    for held in (2.0, 4.0):
        w.acquire()
        w.release(held_s=held)
    assert w.service_s == pytest.approx(2.0 + SERVICE_EWMA * 2.0)


def test_a_late_call_never_shows_a_negative_queue() -> None:
    w = WorkerLoad()
    w.first_token(100, 500)
    w.release(100, 0)
    w.release(0, 900, got_first_token=True)
    assert min(queue(w)) >= 0


async def test_the_pool_and_the_virtual_time_fleet_keep_the_same_queue() -> None:
    cfg = WorkerConfig(url="http://127.0.0.1:9", model="m")
    wid = WorkerId(cfg.id)
    async with httpx.AsyncClient() as client:
        pool = WorkerPool([cfg], client, MonotonicClock())
        sim = Accounting()
        steps = [("acquire", (400,)), ("acquire", (90,)), ("first_token", (400, 2000)), ("acquire", (10,)),
                 ("release", (90, 0, False, None)), ("release", (400, 2000, True, 1.5)), ("first_token", (10, 64))]
        for name, args in steps:
            getattr(pool, name)(wid, *args)
            getattr(sim, name)(*args)
            assert queue(pool.get(wid)) == queue(sim), name
        view, sim_view = pool.get(wid).view(), sim.view(wid)
        assert (view.in_flight, view.pending_prefill_tokens, view.pending_requests, view.decode_requests,
                view.decode_tokens) == (sim_view.in_flight, sim_view.pending_prefill_tokens,
                                        sim_view.pending_requests, sim_view.decode_requests, sim_view.decode_tokens)
        assert pool.get(wid).service_s == sim.service_s == 1.5
