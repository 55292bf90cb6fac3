"""Several gateway replicas on one Redis act as one: each request of a conversation goes to a replica
picked at random, and everything the client sees — cached tokens, loss causes, restored messages,
continuations — equals a one-replica run on fresh, identical workers."""

from __future__ import annotations

import random
import uuid
from typing import Any

import httpx

from kvgate.bench.data import SWE_TRAJECTORIES
from kvgate.bench.swe import load_trajectories, run_client
from kvgate.demo import SYSTEM, USER_TURNS, chat_turn
from tests.conftest import MODEL, Cluster

REDIS = "redis://127.0.0.1:6379/0"


async def replicas(make_cluster: Any, n: int, **gw: Any) -> Cluster:
    return await make_cluster(2, events=True, replicas=n, session_store="redis", redis_url=REDIS,
                              redis_prefix=f"kvgate-test:{uuid.uuid4().hex[:8]}:", **gw)


def relabel(rows: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """Workers named by order of first use: two fleets of fresh, identical workers differ only in ports."""
    names: dict[str, int] = {}
    return [(*r[:3], names.setdefault(r[3], len(names)), *r[4:]) for r in rows]


async def agents(c: Cluster, drop_reasoning: bool, seed: int = 7) -> list[tuple[Any, ...]]:
    """The demo's agents, one request at a time, each to a random replica; a client that drops the
    reasoning from the assistant messages it echoes when ``drop_reasoning``."""
    rng = random.Random(seed)
    rows: list[tuple[Any, ...]] = []
    async with httpx.AsyncClient(timeout=60) as client:
        for conv in ("agent-A", "agent-B"):
            messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
            for user in USER_TURNS:
                messages.append({"role": "user", "content": f"[{conv}] {user}"})
                for _ in range(4):
                    msg, usage, finish, _, h = await chat_turn(client, rng.choice(c.urls), conv, messages)
                    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                    rows.append((conv, usage["prompt_tokens"], cached, h["x-kvgate-worker"],
                                 h.get("x-kvgate-prefix-reuse"), h.get("x-kvgate-history")))
                    messages.append({k: v for k, v in msg.items() if not (drop_reasoning and k == "reasoning")})
                    if finish != "tool_calls":
                        break
                    messages += [{"role": "tool", "tool_call_id": tc["id"], "content": "output " * 40}
                                 for tc in msg["tool_calls"]]
    return relabel(rows)


async def continuations(c: Cluster) -> list[tuple[int, int]]:
    """``previous_response_id`` on every replica, each continuing the response another one gave."""
    out = []
    async with httpx.AsyncClient(timeout=60) as h:
        body: dict[str, Any] = {"model": MODEL, "max_tokens": 8, "messages": [
            {"role": "system", "content": SYSTEM}, {"role": "user", "content": "start"}]}
        r = await h.post(c.urls[0] + "/v1/chat/completions", json=body, headers={"x-conversation-id": "stateful"})
        rid = r.json()["id"]
        for i in range(3):
            url = c.urls[(i + 1) % len(c.urls)]
            r = await h.post(url + "/v1/chat/completions", json={
                "model": MODEL, "previous_response_id": rid, "max_tokens": 8,
                "messages": [{"role": "user", "content": "and then?"}]})
            assert r.status_code == 200, r.text
            rid = r.json()["id"]
            u = r.json()["usage"]
            out.append((u["prompt_tokens"], (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)))
    return out


async def test_three_replicas_equal_one(make_cluster: Any) -> None:
    one = await replicas(make_cluster, 1)
    three = await replicas(make_cluster, 3)
    for drop in (False, True):
        a, b = await agents(one, drop), await agents(three, drop)
        assert a == b
    assert any(r[4] and "restored=0" not in (r[5] or "") for r in b)  # restoration ran across replicas
    assert await continuations(one) == await continuations(three)


async def test_the_swe_replay_through_random_replicas_equals_one(make_cluster: Any) -> None:
    trajectories = load_trajectories(SWE_TRAJECTORIES, max_chars=1500)[:3]
    for client in ("re-serialising client", "kvgate canonical (drop at turn end)"):
        results = []
        for n in (1, 3):
            c = await replicas(make_cluster, n, sim={"speed": 200.0, "profile": "h100-llama3-8b",
                                                     "max_model_len": 65536, "num_blocks": 20_000},
                               max_body_bytes=16 * 1024 * 1024)
            async with httpx.AsyncClient(timeout=60) as http:
                r = await run_client(client, trajectories, c.urls, http, random.Random(3))
            results.append((r.prompt_tokens, r.cached, r.requests, dict(r.causes or {}), r.explained, r.measured))
        assert results[0] == results[1], client
