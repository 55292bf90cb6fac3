"""The worker pool: what it reads from a worker's /metrics, and the hashing it learns there."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx

from kvgate.clock import MonotonicClock
from kvgate.config import WorkerConfig
from kvgate.gateway.enginemetrics import parse_metrics
from kvgate.gateway.health import Health
from kvgate.gateway.workers import WorkerPool
from kvgate.router.hashing import HashSpec
from kvgate.router.types import WorkerId
from kvgate.serving import free_port, start_server
from kvgate.sim.server import SimWorker
from kvgate.sim.settings import SimSettings

DATA = Path(__file__).parent / "data"


def test_parses_a_real_vllm_exposition() -> None:
    m = parse_metrics((DATA / "vllm-0.32-metrics.txt").read_text(), "vllm")
    assert (m.hash_block_size, m.hash_algo, m.kv_block_size, m.num_gpu_blocks) == (128, "sha256_cbor", 128, 16384)
    assert m.started_at == 1.79610799416e09 and (m.running, m.waiting, m.kv_usage) == (0, 0, 0.0)


def test_hash_block_size_wins_over_the_scheduler_block_size() -> None:
    text = ('vllm:cache_config_info{block_size="64",hash_block_size="16",prefix_caching_hash_algo="sha256",'
            'num_gpu_blocks="10"} 1.0\n')
    m = parse_metrics(text, "vllm")
    assert (m.hash_block_size, m.kv_block_size, m.started_at, m.running) == (16, 64, None, None)


async def test_pool_learns_the_workers_hashing_and_counts_a_mismatch_once(model_dir: Path) -> None:
    sim = SimWorker(SimSettings(model_dir=str(model_dir), hash_algo="sha256_cbor", block_size=64, hash_seed="7"))
    h = await start_server(sim.build_app())
    client = httpx.AsyncClient()
    try:
        cfg = WorkerConfig(url=h.url, model="m", engine="sim", block_size=16, hash_algo="sha256")
        other = WorkerConfig(url="http://127.0.0.1:9", model="m", hash_seed="own")
        pool = WorkerPool([cfg, other], client, MonotonicClock(), hash_seed="7")
        wid = WorkerId(cfg.id)
        assert pool.spec(wid) == HashSpec(16, "sha256", "7")  # before the worker is heard from
        await pool.check_all()
        await pool.check_all()
        assert pool.spec(wid) == HashSpec(64, "sha256_cbor", "7")
        assert pool.mismatches == {(wid, "block_size"): 1, (wid, "hash_algo"): 1}
        # Distinct identities of the model's workers; the unreachable one keeps its configured setup.
        assert pool.specs("m") == [HashSpec(64, "sha256_cbor", "7"), HashSpec(16, "sha256", "own")]
    finally:
        await client.aclose()
        await h.stop()


async def test_a_worker_up_after_the_pool_started_still_gives_its_context_length(model_dir: Path) -> None:
    # kvgate started before its worker (a Deployment's pods in any order): the prompt limit is the worker's
    # once it answers, not the tokenizer's fallback for ever.
    port = free_port()
    client = httpx.AsyncClient()
    pool = WorkerPool([WorkerConfig(url=f"http://127.0.0.1:{port}", model="m", engine="sim")], client,
                      MonotonicClock())
    heard: list[tuple[str, int]] = []
    pool.on_context(lambda model, n: heard.append((model, n)))
    sim = SimWorker(SimSettings(model_dir=str(model_dir), max_model_len=65536, port=port))
    try:
        await pool.check_all()
        assert heard == []
        h = await start_server(sim.build_app(), port=port)
        await pool.check_all()
        await pool.check_all()
        assert heard == [("m", 65536)]  # read once, not on every check
        (w,) = pool.all()
        assert w.max_model_len == 65536
        await h.stop()
    finally:
        await client.aclose()


class ToyWorker:
    """A worker whose /health answer and process start time the test sets (a real HTTP server)."""

    def __init__(self) -> None:
        from fastapi import FastAPI, Response

        self.status = 200
        self.delay = 0.0
        self.started = 1000.0
        self.app = FastAPI()

        @self.app.get("/health")
        async def health() -> Response:
            await asyncio.sleep(self.delay)
            return Response(status_code=self.status)

        @self.app.get("/metrics")
        async def metrics() -> Response:
            return Response(f"process_start_time_seconds {self.started}\n")


async def test_a_restart_or_a_return_is_reported_before_the_worker_is_eligible() -> None:
    toy = ToyWorker()
    h = await start_server(toy.app)
    client = httpx.AsyncClient()
    try:
        cfg = WorkerConfig(url=h.url, model="m")
        pool = WorkerPool([cfg], client, MonotonicClock())
        wid = WorkerId(cfg.id)
        seen: list[tuple[WorkerId, bool]] = []
        pool.on_restart(lambda w: seen.append((w, pool.get(w).healthy)))
        await pool.check_all()
        assert pool.get(wid).healthy and seen == []  # the first sight of a worker is no restart
        toy.started = 2000.0  # restarted between two checks, never seen down
        await pool.check_all()
        assert seen == [(wid, True)] and pool.restarts == {(wid, "process_restarted"): 1}
        toy.status = 503
        await pool.check_all()
        assert pool.get(wid).healthy  # one failed check is not enough to eject
        await pool.check_all()
        await pool.check_all()
        assert not pool.get(wid).healthy and pool.get(wid).health.state is Health.DOWN
        toy.status = 200  # back, same process (a network partition healed): its events may be lost
        await pool.check_all()
        assert seen[-1] == (wid, False) and pool.get(wid).healthy
        assert pool.restarts[(wid, "readmitted")] == 1 and pool.get(wid).health.state is Health.PROBATION
    finally:
        await client.aclose()
        await h.stop()


async def test_one_slow_health_check_does_not_eject_a_worker() -> None:
    toy = ToyWorker()
    h = await start_server(toy.app)
    client = httpx.AsyncClient()
    try:
        cfg = WorkerConfig(url=h.url, model="m")
        pool = WorkerPool([cfg], client, MonotonicClock(), timeout_s=0.1)
        wid = WorkerId(cfg.id)
        await pool.check_all()
        toy.delay = 0.3
        await pool.check_all()
        assert pool.get(wid).healthy and "ReadTimeout" in pool.get(wid).last_error
        toy.delay = 0.0
        await pool.check_all()
        assert pool.get(wid).health.failures == 0
        pool.mark_failed(wid, "ReadTimeout()", "ReadTimeout")  # a request that timed out: soft
        assert pool.get(wid).healthy
        pool.mark_failed(wid, "ConnectError()", "ConnectError")  # nothing listens: out at once
        assert not pool.get(wid).healthy
    finally:
        await client.aclose()
        await h.stop()


async def test_pool_learns_the_engines_running_cap_and_who_else_runs_there(model_dir: Path) -> None:
    # Two sequences at once, slow steps: four requests sent straight to the engine (not through this pool)
    # leave two waiting, which its counters show after the next step.
    sim = SimWorker(SimSettings(model_dir=str(model_dir), max_num_seqs=2, profile="cpu-tiny", speed=0.05))
    h = await start_server(sim.build_app())
    client = httpx.AsyncClient(timeout=60)
    body = {"model": "kvgate-tiny", "prompt": "hello", "max_tokens": 50}
    cfg = WorkerConfig(url=h.url, model="kvgate-tiny", engine="sim")
    pool = WorkerPool([cfg], client, MonotonicClock())
    await pool.check_all()
    w = pool.get(WorkerId(cfg.id))
    assert w.cap is None and w.free_slots() is None  # never seen saturated: unknown, nothing held back
    sends = [asyncio.create_task(client.post(f"{h.url}/v1/completions", json=body)) for _ in range(4)]
    try:
        for _ in range(500):
            if sim.core.step_stats() == (2, 2):
                break
            await asyncio.sleep(0.01)
        assert sim.core.step_stats() == (2, 2)
        await pool.check_all()
        assert w.cap == 2 and w.foreign == 4 and w.free_slots() == 0
        v = w.view()
        assert (v.max_running, v.foreign_requests) == (2, 4)
        configured = WorkerPool([cfg], client, MonotonicClock(), worker_slots=8)
        await configured.check_all()
        assert configured.get(WorkerId(cfg.id)).cap == 8  # a configured cap wins over the learned one
    finally:
        for t in sends:
            t.cancel()
        await asyncio.gather(*sends, return_exceptions=True)
        await client.aclose()
        await h.stop()
