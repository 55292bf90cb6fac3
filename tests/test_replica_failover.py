"""A gateway replica killed with SIGKILL while it runs a background prefill: three replicas as real
processes on one Redis. The prefill it owned runs again, once, on a survivor after its lease; the
conversation loses nothing and the next user turn finds the prefilled prefix."""

from __future__ import annotations

import asyncio
import json
import signal
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvgate.serving import start_server
from kvgate.sim.server import SimWorker
from kvgate.sim.settings import SimSettings
from tests.conftest import MODEL, free_port
from tests.helpers import TOOLS

PREFILL_HOLD_S = 6.0


def slow_prefills(app: ASGIApp) -> ASGIApp:
    """The simulated worker, but a background prefill (a completion of one token) is held for a while
    before the engine sees it: long enough to kill the replica that sent it."""

    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] != "/v1/completions":
            await app(scope, receive, send)
            return
        body = b""
        more = True
        while more:
            msg = await receive()
            body += msg.get("body", b"")
            more = msg.get("more_body", False)
        if json.loads(body).get("max_tokens") == 1:
            await asyncio.sleep(PREFILL_HOLD_S)
        sent = False

        async def replay() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await app(scope, replay, send)

    return wrapped


async def metric(url: str, name: str, **labels: str) -> float:
    async with httpx.AsyncClient() as h:
        text = (await h.get(url + "/metrics", timeout=5)).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def until(pred: Any, timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = await pred()
        if got is not None and got is not False:  # a replica's index 0 is an answer
            return got
        await asyncio.sleep(0.05)
    raise TimeoutError("condition not met")


async def test_sigkill_mid_prefill_hands_it_over_once(spawn: Any, model_dir: Path) -> None:
    w = SimWorker(SimSettings(model_dir=str(model_dir), hash_seed="0", speed=20.0, profile="h100-llama3-8b",
                              kv_events_endpoint=f"tcp://127.0.0.1:{free_port()}",
                              kv_replay_endpoint=f"tcp://127.0.0.1:{free_port()}"))
    sim = await start_server(slow_prefills(w.build_app()))  # type: ignore[arg-type]
    env = {"PYTHONHASHSEED": "0", "KVGATE_SESSION_STORE": "redis",
           "KVGATE_REDIS_PREFIX": f"kvgate-test:{uuid.uuid4().hex[:8]}:", "KVGATE_HASH_SEED": "0",
           "KVGATE_TOKENIZERS": json.dumps({MODEL: str(model_dir)}), "KVGATE_TIMER_LEASE_S": "2",
           "KVGATE_TIMER_TICK_S": "0.05", "KVGATE_HEALTH_INTERVAL_S": "0.5",
           "KVGATE_PREFILL": json.dumps({"enabled": True, "min_continue": 0.0, "min_gain_tokens": 16}),
           "KVGATE_WORKERS": json.dumps([{"url": sim.url, "model": MODEL, "engine": "sim", "block_size": 16,
                                          "kv_events": "auto"}])}
    ports = [free_port() for _ in range(3)]
    procs = [spawn("serve", "--port", str(p), env=env) for p in ports]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    try:
        for p, u in zip(procs, urls, strict=True):
            await p.wait_http(u + "/ready")
        async with httpx.AsyncClient(timeout=60) as h:
            async def chat(url: str, msgs: list[dict[str, Any]], **sim_: Any) -> dict[str, Any]:
                r = await h.post(url + "/v1/chat/completions", headers={"x-conversation-id": "fo"},
                                 json={"model": MODEL, "messages": msgs, "tools": TOOLS, "sim": sim_})
                assert r.status_code == 200, r.text
                return r.json()  # type: ignore[no-any-return]

            msgs: list[dict[str, Any]] = [{"role": "system", "content": "agent " * 200},
                                          {"role": "user", "content": "go"}]
            m = (await chat(urls[0], msgs, tool_calls=1, reasoning_tokens=200))["choices"][0]["message"]
            msgs += [{k: v for k, v in m.items() if v is not None},
                     {"role": "tool", "tool_call_id": m["tool_calls"][0]["id"], "content": "result " * 150}]
            a = (await chat(urls[1], msgs, tool_calls=0, reasoning_tokens=100, answer_tokens=40))
            msgs += [{k: v for k, v in a["choices"][0]["message"].items() if v is not None}]

            async def owner() -> int | None:
                issued = [await metric(u, "kvgate_prefill_decisions_total", reason="issued") for u in urls]
                return next((i for i, n in enumerate(issued) if n), None)

            killed = await until(owner, 30)  # some replica claimed the prefill timer and sent the prefill
            assert await metric(urls[killed], "kvgate_prefills_total", outcome="completed") == 0  # still running
            procs[killed].signal(signal.SIGKILL)
            procs[killed].popen.wait(timeout=10)
            alive = [u for i, u in enumerate(urls) if i != killed]

            async def completed() -> bool:
                return sum([await metric(u, "kvgate_prefills_total", outcome="completed") for u in alive]) >= 1

            await until(completed, 40)  # after the 2 s lease a survivor ran it again
            issued = sum([await metric(u, "kvgate_prefills_total", outcome="issued") for u in alive])
            done = sum([await metric(u, "kvgate_prefills_total", outcome="completed") for u in alive])
            assert (issued, done) == (1, 1)
            conv = (await h.get(alive[0] + "/admin/conversations/fo")).json()
            assert conv["turn_count"] == 2 and conv["lifecycle"]["state"] == "awaiting_user"
            prefix = (await h.get(alive[1] + "/admin/conversations/fo/next-prefix")).json()["tokens"]
            nxt = await chat(alive[1], [*msgs, {"role": "user", "content": "thanks, and now?"}], tool_calls=0)
            cached = nxt["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached >= prefix // 16 * 16 - 16, (cached, prefix)
            used = sum([await metric(u, "kvgate_prefills_total", outcome="used") for u in alive])
            assert used == 1
    finally:
        await sim.stop()
