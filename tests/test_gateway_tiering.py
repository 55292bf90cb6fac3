"""The session lifecycle, reservations, background prefill and tier faults through the gateway."""

from __future__ import annotations

from typing import Any

import httpx

from kvgate.kvstore.tiers import LMCacheControl
from tests.conftest import Cluster, free_port
from tests.test_gateway import eventually, metric
from tests.test_gateway_history import chat, ready


async def admin(c: Cluster, path: str) -> Any:
    async with httpx.AsyncClient() as h:
        return (await h.get(c.url + path)).json()


async def test_tool_wait_reserves_kv_and_is_measured_when_the_session_resumes(make_cluster: Any) -> None:
    c = await make_cluster(2, events=True, waits={"tool_priors_s": {"search": 1.0}, "reserve_max_s": 5.0})
    await ready(c)
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "agent " * 200}, {"role": "user", "content": "go"}]
    r1 = await chat(c, "tw", msgs, sim={"tool_calls": [{"name": "search", "arguments": {"q": "x"}}]})
    assert r1.status_code == 200
    home = r1.headers["x-kvgate-worker"]
    conv = await admin(c, "/admin/conversations/tw")
    life = conv["lifecycle"]
    assert life["state"] == "awaiting_tool" and life["tools"] == ["search"]
    assert life["plan"][0] == 1.0 and life["plan"][1] == "reserve"
    workers = {w["id"]: w for w in (await admin(c, "/admin/workers"))["workers"]}
    usage = r1.json()["usage"]
    assert workers[home]["reserved_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]

    m = r1.json()["choices"][0]["message"]
    msgs += [{k: v for k, v in m.items() if v is not None},
             {"role": "tool", "tool_call_id": m["tool_calls"][0]["id"], "content": "found it"}]
    r2 = await chat(c, "tw", msgs, sim={"tool_calls": 0})
    assert r2.status_code == 200 and r2.headers["x-kvgate-worker"] == home
    assert (await admin(c, "/admin/conversations/tw"))["lifecycle"]["state"] == "awaiting_user"
    workers = {w["id"]: w for w in (await admin(c, "/admin/workers"))["workers"]}
    assert all(w["reserved_tokens"] == 0 for w in workers.values())
    assert await metric(c, "kvgate_tool_waits_total", outcome="within") == 1
    assert (await admin(c, "/admin/tiers"))["waits"]["observed"] == 1


def reply(r: httpx.Response) -> dict[str, Any]:
    return {k: v for k, v in r.json()["choices"][0]["message"].items() if v is not None}


async def tool_chain_then_answer(c: Cluster, conv: str) -> tuple[list[dict[str, Any]], httpx.Response, httpx.Response]:
    """A turn whose tool call carries long reasoning and whose answer ends it: the next user turn drops
    that reasoning. Returns the history so far and the two responses."""
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "agent " * 200}, {"role": "user", "content": "go"}]
    r1 = await chat(c, conv, msgs, sim={"tool_calls": 1, "reasoning_tokens": 400})
    m = reply(r1)
    msgs += [m, {"role": "tool", "tool_call_id": m["tool_calls"][0]["id"], "content": "result " * 150}]
    r2 = await chat(c, conv, msgs, sim={"tool_calls": 0, "reasoning_tokens": 100, "answer_tokens": 40})
    return [*msgs, reply(r2), {"role": "user", "content": "thanks, and now?"}], r1, r2


async def test_background_prefill_makes_the_next_user_turn_find_the_canonical_prefix(make_cluster: Any) -> None:
    c = await make_cluster(1, events=True, prefill={"enabled": True, "min_gain_tokens": 128, "min_continue": 0.5})
    await ready(c)
    msgs, _, r2 = await tool_chain_then_answer(c, "bp")
    assert r2.status_code == 200
    # The turn ended: the next request drops this turn's reasoning, so kvgate prefills P|A now.
    async def prefilled() -> bool:
        return await metric(c, "kvgate_prefills_total", outcome="completed") == 1

    await eventually(prefilled, timeout_s=10)
    assert await metric(c, "kvgate_prefill_decisions_total", reason="issued") == 1
    async with httpx.AsyncClient() as h:
        prefix = (await h.get(c.url + "/admin/conversations/bp/next-prefix")).json()["tokens"]
    r3 = await chat(c, "bp", msgs, sim={"tool_calls": 0})
    cached = r3.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= prefix // 16 * 16 - 16, (cached, prefix)
    tiers = await admin(c, "/admin/tiers")
    assert tiers["prefill"]["used"] == 1 and tiers["prefill"]["wasted"] == 0


async def test_without_prefill_the_same_turn_recomputes_the_answer(make_cluster: Any) -> None:
    c = await make_cluster(1, events=True)
    await ready(c)
    msgs, r1, _ = await tool_chain_then_answer(c, "np")
    async with httpx.AsyncClient() as h:
        prefix = (await h.get(c.url + "/admin/conversations/np/next-prefix")).json()["tokens"]
    r3 = await chat(c, "np", msgs, sim={"tool_calls": 0})
    # Reused only up to the first dropped reasoning (inside turn 1's first reply), far short of P|A.
    cached = r3.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached <= r1.json()["usage"]["prompt_tokens"] < prefix - 128
    assert await metric(c, "kvgate_prefills_total") == 0


async def test_a_dead_remote_tier_is_counted_and_requests_go_on(make_cluster: Any) -> None:
    c = await make_cluster(2, events=True, tier_redis_url=f"redis://127.0.0.1:{free_port()}/0")
    await ready(c)
    for i in range(3):
        r = await chat(c, f"dead-{i}", [{"role": "user", "content": f"task {i} " * 200}], sim={"tool_calls": 0})
        assert r.status_code == 200
    assert await metric(c, "kvgate_tier_lookups_total", tier="remote", state="down") >= 1
    tiers = await admin(c, "/admin/tiers")
    assert tiers["remote_tier"]["up"] is False and tiers["remote_tier"]["errors"] == 1  # one timeout, then skipped


async def test_a_dead_lmcache_fails_the_prefetch_not_the_request(make_cluster: Any) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    c = await make_cluster(1, events=True, waits={"tool_priors_s": {"search": 0.6}, "reserve_max_s": 0.1,
                                                  "prefetch_lead_s": 0.5})
    for w in c.gateway.settings.workers:  # the worker's LMCache server is not running
        c.gateway.tiers.lmcache[w.id] = LMCacheControl(dead, c.gateway.client, c.gateway.clock.now)
    await ready(c)
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "agent " * 200}, {"role": "user", "content": "go"}]
    r1 = await chat(c, "pf", msgs, sim={"tool_calls": [{"name": "search", "arguments": {"q": "x"}}]})
    life = (await admin(c, "/admin/conversations/pf"))["lifecycle"]
    assert life["plan"][1] == "release"  # a 0.6 s wait is "long" here: prefetch at +0.1 s

    async def failed() -> bool:
        return await metric(c, "kvgate_tier_prefetches_total", outcome="failed") == 1

    await eventually(failed)
    m = r1.json()["choices"][0]["message"]
    msgs += [{k: v for k, v in m.items() if v is not None},
             {"role": "tool", "tool_call_id": m["tool_calls"][0]["id"], "content": "ok"}]
    assert (await chat(c, "pf", msgs, sim={"tool_calls": 0})).status_code == 200
    tiers = await admin(c, "/admin/tiers")
    assert all(not v["up"] and v["errors"] == 1 for v in tiers["lmcache"].values())
