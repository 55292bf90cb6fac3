"""``kvgate serve --workers 2`` as a real process tree on a real Redis, in front of simulated workers:
the two processes act as one gateway (kvgate/supervisor.py, kvgate/podview.py)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvgate.demo import SYSTEM, USER_TURNS, chat_turn
from kvgate.serving import ServerHandle, start_server
from kvgate.sim.server import SimWorker
from kvgate.sim.settings import SimSettings
from kvgate.tune.log import read_logs
from tests.conftest import MODEL, Proc, free_port

REDIS = "redis://127.0.0.1:6379/0"
T = TypeVar("T")


def fresh_connections(timeout: float = 60.0) -> httpx.AsyncClient:
    """Every request on a new connection, so each one goes to whichever process accepts it."""
    return httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_keepalive_connections=0))


async def sims(model_dir: Path, n: int) -> list[tuple[SimWorker, ServerHandle]]:
    out = []
    for _ in range(n):
        w = SimWorker(SimSettings(model_dir=str(model_dir), hash_seed="0", speed=20.0,
                                  kv_events_endpoint=f"tcp://127.0.0.1:{free_port()}",
                                  kv_replay_endpoint=f"tcp://127.0.0.1:{free_port()}"))
        out.append((w, await start_server(w.build_app())))
    return out


def serve_args(workers: list[tuple[SimWorker, ServerHandle]], model_dir: Path, port: int, *extra: str) -> list[str]:
    args = ["serve", *extra, "--workers", "2", "--port", str(port), "--session-store", "redis", "--redis-url", REDIS,
            "--redis-prefix", f"kvgate-test:{uuid.uuid4().hex[:8]}:", "--hash-seed", "0",
            "--health-interval-s", "0.5", "--tokenizers", f'{{"{MODEL}": "{model_dir}"}}',
            "--drain-timeout-s", "20"]
    for w, h in workers:
        args += ["--worker", f"{h.url}={MODEL}@sim,kv_events=auto,block_size={w.profile.block_size}"]
    return args


async def agent(client: httpx.AsyncClient, url: str, conv: str) -> list[tuple[int, int, str]]:
    """The demo's agent (kvgate/demo.py): (expected cached, reported cached, process) per request."""
    rows = []
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    for user in USER_TURNS:
        messages.append({"role": "user", "content": f"[{conv}] {user}"})
        for _ in range(4):
            msg, usage, finish, _, h = await chat_turn(client, url, conv, messages)
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            rows.append((int(h["x-kvgate-expected-cached-tokens"]), cached, h["x-kvgate-process"]))
            messages.append(msg)
            if finish != "tool_calls":
                break
            messages += [{"role": "tool", "tool_call_id": tc["id"], "content": "output " * 40}
                         for tc in msg["tool_calls"]]
    return rows


async def later(delay_s: float, aw: Awaitable[T]) -> T:
    await asyncio.sleep(delay_s)
    return await aw


def chat_requests_by_process(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        if fam.name == "kvgate_requests":
            for s in fam.samples:
                if s.name == "kvgate_requests_total" and s.labels.get("endpoint") == "chat":
                    out[s.labels["process"]] = out.get(s.labels["process"], 0.0) + s.value
    return out


async def policy_seen(client: httpx.AsyncClient, url: str, decode_ms: float, timeout_s: float) -> float:
    """Seconds until both processes answer GET /admin/policy with ``decode_ms``."""
    t0 = time.monotonic()
    seen: set[str] = set()
    while time.monotonic() - t0 < timeout_s:
        r = await client.get(url + "/admin/policy")
        if r.json()["cost"]["decode_ms"] == decode_ms:
            seen.add(r.headers["x-kvgate-process"])
        if seen == {"0", "1"}:
            return time.monotonic() - t0
        await asyncio.sleep(0.02)
    raise AssertionError(f"only processes {sorted(seen)} applied the edit within {timeout_s} s")


async def test_two_processes_act_as_one_gateway(model_dir: Path, spawn: Any, tmp_path: Path) -> None:
    workers = await sims(model_dir, 2)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    request_log = tmp_path / "requests.jsonl"
    try:
        gw: Proc = spawn(*serve_args(workers, model_dir, port, "--request-log", str(request_log)))
        await gw.wait_http(url + "/ready", timeout_s=90)
        async with fresh_connections() as client:
            ready = (await client.get(url + "/ready")).json()
            assert [p["ready"] for p in ready["processes"]] == [True, True]
            pids = {p["pid"] for p in ready["processes"]}
            assert len(pids) == 2 and gw.popen.pid not in pids

            # The agents start 0.5 s apart. All at once, one's first request could be accepted by the process
            # that did not send the other's (same system prompt) and has no event for it yet: a process
            # counts only its own requests in flight, so it expected 0 where the worker had 640 cached
            # (seen once here; docs/operations.md). Apart, every process knows by events what is cached.
            per_agent = await asyncio.gather(*(later(i * 0.5, agent(client, url, f"agent-{c}"))
                                               for i, c in enumerate("ABCD")))
            rows = [r for a in per_agent for r in a]
            assert len(rows) >= 12 and all(c > 0 for a in per_agent for _, c, _ in a[1:])
            assert [(e, c) for e, c, _ in rows] == [(c, c) for _, c, _ in rows], rows  # expected == reported
            assert {p for _, _, p in rows} == {"0", "1"}
            served = chat_requests_by_process((await client.get(url + "/metrics")).text)
            assert set(served) == {"0", "1"} and sum(served.values()) == len(rows), served

            # One PATCH, to whichever process accepts it: both decide with it within a second.
            before = (await client.get(url + "/admin/policy")).json()["cost"]["decode_ms"]
            r = await client.patch(url + "/admin/policy", json={"cost": {"decode_ms": before + 1.25}})
            assert r.status_code == 200, r.text
            assert await policy_seen(client, url, before + 1.25, 1.0) < 1.0

            # A process that dies is started again; /ready says 503 until it serves.
            victim = ready["processes"][1]["pid"]
            os.kill(victim, signal.SIGKILL)
            await asyncio.sleep(0.2)
            assert (await client.get(url + "/ready")).status_code == 503
            await gw.wait_http(url + "/ready", timeout_s=60)
            again = (await client.get(url + "/ready")).json()["processes"]
            assert again[0]["pid"] == ready["processes"][0]["pid"] and again[1]["pid"] not in pids

            # SIGTERM to the supervisor alone (what Kubernetes sends PID 1): a request in flight finishes,
            # /ready turns 503, every process exits, and so does the supervisor, with 0.
            body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                    "sim": {"reasoning_tokens": 2000, "answer_tokens": 5}}
            slow = asyncio.create_task(client.post(url + "/v1/chat/completions", json=body))
            await asyncio.sleep(0.5)
            assert not slow.done()
            os.kill(gw.popen.pid, signal.SIGTERM)
            r = await slow
            assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "stop"
        assert await asyncio.to_thread(gw.popen.wait, 40) == 0, gw.tail()
        for pid in {p["pid"] for p in again}:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
        assert "Traceback" not in gw.log_path.read_text(), gw.tail(60)
    finally:
        for _, h in workers:
            await h.stop()
    check_request_logs(tmp_path, len(rows))


def check_request_logs(where: Path, requests: int) -> None:
    """A request log per process, keyed alike: they replay together (the agents' first prompts share
    their system prompt's blocks, so their first logged hash is one, whichever process logged it)."""
    logs = sorted(where.glob("requests.jsonl.p*"))
    assert [p.name for p in logs] == ["requests.jsonl.p0", "requests.jsonl.p1"]
    entries = read_logs(logs).entries
    assert len([e for e in entries if e.conv.startswith("agent-")]) == requests
    firsts = {e.new[0] for e in entries if e.conv.startswith("agent-") and e.k == 0 and e.new}
    assert len(firsts) == 1, firsts


@pytest.mark.parametrize("extra", [[], ["--session-store", "memory"]])
def test_more_than_one_process_on_the_memory_store_refuses_to_start(extra: list[str], clean_env: Any) -> None:
    r = subprocess.run([sys.executable, "-m", "kvgate.cli", "serve", "--workers", "2", "--port", str(free_port()),
                        *extra], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "processes: 2 needs session_store: redis" in r.stderr and "Traceback" not in r.stderr


def test_merged_metrics_keep_each_family_together_with_a_process_label() -> None:
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    from kvgate.podview import exposition, merge_expositions

    texts = {}
    for i in range(2):
        r = CollectorRegistry()
        Counter("kvgate_requests", "Requests.", ["endpoint"], registry=r).labels("chat").inc(i + 1)
        Gauge("kvgate_worker_healthy", "Healthy.", ["worker"], registry=r).labels("w0").set(i)
        Histogram("kvgate_ttft_seconds", "TTFT.", buckets=[0.1, 1.0], registry=r).observe(0.5)
        texts[i] = generate_latest(r).decode()
    text = exposition(merge_expositions(texts)).decode()
    # The text format wants one group per family: each TYPE line once, its samples right after it.
    assert text.count("# TYPE kvgate_requests_total counter") == 1
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    req = {s.labels["process"]: s.value for s in fams["kvgate_requests"].samples if s.name.endswith("_total")}
    assert req == {"0": 1.0, "1": 2.0}
    healthy = {s.labels["process"]: s.value for s in fams["kvgate_worker_healthy"].samples}
    assert healthy == {"0": 0.0, "1": 1.0}  # a gauge per process, not summed
    counts = [s for s in fams["kvgate_ttft_seconds"].samples if s.name == "kvgate_ttft_seconds_count"]
    assert sorted(s.labels["process"] for s in counts) == ["0", "1"]


async def test_children_of_a_killed_supervisor_drain_and_exit(model_dir: Path, spawn: Any) -> None:
    workers = await sims(model_dir, 1)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    pids: list[int] = []
    try:
        gw: Proc = spawn(*serve_args(workers, model_dir, port))
        await gw.wait_http(url + "/ready", timeout_s=90)
        async with fresh_connections() as client:
            pids = [p["pid"] for p in (await client.get(url + "/ready")).json()["processes"]]
        os.kill(gw.popen.pid, signal.SIGKILL)  # the OOM killer's way: no SIGTERM relayed
        for _ in range(300):  # 30 s
            if not any(_alive(p) for p in pids):
                break
            await asyncio.sleep(0.1)
        assert not any(_alive(p) for p in pids), gw.tail()
        assert "Traceback" not in gw.log_path.read_text(), gw.tail(60)
    finally:
        for pid in filter(_alive, pids):  # the spawn fixture signals the group of a live supervisor only
            os.kill(pid, signal.SIGKILL)
        for _, h in workers:
            await h.stop()


def _alive(pid: int) -> bool:
    """Running, and not a zombie its (dead) supervisor left for init to reap."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_process_that_cannot_start_ends_the_start_up_rather_than_restarting(tmp_path: Path) -> None:
    # Start-up reads the tokenizer directory only in the children: the supervisor's settings check passes.
    r = subprocess.run([sys.executable, "-m", "kvgate.cli", "serve", "--workers", "2", "--port", str(free_port()),
                        "--session-store", "redis", "--redis-prefix", f"kvgate-test:{uuid.uuid4().hex[:8]}:",
                        "--tokenizers", f'{{"{MODEL}": "{tmp_path / "missing"}"}}'],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stderr[-2000:]
    assert "during start-up" in r.stderr and "starting it again" not in r.stderr
