"""Turn-scoped reasoning through the gateway: restoration, policies, and the loss explanation."""

from __future__ import annotations

import json
from typing import Any

import httpx

from tests.conftest import MODEL, Cluster
from tests.test_gateway import TOOLS, eventually, metric


async def chat(c: Cluster, conv: str, messages: list[dict[str, Any]], headers: dict[str, str] | None = None,
               **extra: Any) -> httpx.Response:
    body = {"model": MODEL, "messages": messages, "tools": TOOLS, **extra}
    async with httpx.AsyncClient(timeout=30) as h:
        return await h.post(c.url + "/v1/chat/completions", json=body,
                            headers={"x-conversation-id": conv, **(headers or {})})


def reuse(r: httpx.Response) -> dict[str, str]:
    return dict(kv.split("=", 1) for kv in r.headers["x-kvgate-prefix-reuse"].split("; "))


async def ready(c: Cluster) -> None:
    await eventually(lambda: len(c.gateway.prefix.events.workers()) == len(c.sims))


async def test_reserialised_tool_arguments_are_restored_and_keep_the_cache(make_cluster: Any) -> None:
    c = await make_cluster(1, events=True)
    await ready(c)
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "agent " * 200}, {"role": "user", "content": "go"}]
    r1 = await chat(c, "rs", msgs, sim={"tool_calls": [{"name": "search", "arguments": {"q": "kv cache", "k": 3}}]})
    m = r1.json()["choices"][0]["message"]
    call = m["tool_calls"][0]
    # The client re-serialises: compact JSON, keys reordered, reasoning under another name.
    echoed = {"role": "assistant", "content": m["content"], "reasoning_content": m["reasoning"],
              "tool_calls": [{**call, "function": {"name": "search", "arguments": json.dumps(
                  dict(reversed(list(json.loads(call["function"]["arguments"]).items()))), separators=(",", ":"))}}]}
    r2 = await chat(c, "rs", [*msgs, echoed, {"role": "tool", "tool_call_id": call["id"], "content": "found"}])
    assert r2.status_code == 200
    assert "restored=2" in r2.headers["x-kvgate-history"]
    info = reuse(r2)
    async with httpx.AsyncClient() as h:
        rec = (await h.get(c.url + "/admin/conversations/rs")).json()
    assert info["cause"] in ("none", "block_alignment") and int(info["lost"]) < 128, (info, rec["turns"][-1])
    usage = r2.json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == int(info["expected"])
    assert await metric(c, "kvgate_history_restored_total", field="tool_calls.arguments") == 1


async def test_new_user_turn_reports_reasoning_dropped_and_policy_drop(make_cluster: Any) -> None:
    c = await make_cluster(1, events=True)
    await ready(c)
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "agent " * 200}, {"role": "user", "content": "hi"}]
    r1 = await chat(c, "rd", msgs, sim={"tool_calls": 0, "reasoning_tokens": 200})
    msgs += [{k: v for k, v in r1.json()["choices"][0]["message"].items() if v is not None},
             {"role": "user", "content": "and then?"}]
    r2 = await chat(c, "rd", msgs, sim={"tool_calls": 0}, headers={"x-kvgate-reasoning-policy": "drop"})
    info = reuse(r2)
    assert info["cause"] == "reasoning_dropped" and int(info["lost"]) > 0
    assert "policy=drop" in r2.headers["x-kvgate-history"]
    async with httpx.AsyncClient() as h:
        rec = (await h.get(c.url + "/admin/conversations/rd")).json()
    assert rec["turns"][-1]["loss_cause"] == "reasoning_dropped"
    assert await metric(c, "kvgate_prefix_tokens_lost_total", cause="reasoning_dropped") == int(info["lost"])


async def test_client_edit_is_named(make_cluster: Any) -> None:
    c = await make_cluster(1, events=True)
    await ready(c)
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "agent " * 200},
                                  {"role": "user", "content": "first question " * 30}]
    r1 = await chat(c, "ce", msgs, sim={"tool_calls": 0})
    reply = {k: v for k, v in r1.json()["choices"][0]["message"].items() if v is not None}
    edited = [msgs[0], {"role": "user", "content": "a different first question " * 30}, reply,
              {"role": "user", "content": "next"}]
    r2 = await chat(c, "ce", edited, sim={"tool_calls": 0})
    info = reuse(r2)
    assert info["cause"] == "client_edit"
    async with httpx.AsyncClient() as h:
        rec = (await h.get(c.url + "/admin/conversations/ce")).json()
    assert rec["turns"][-1]["loss_detail"] == "message 1"


async def test_bad_reasoning_policy_is_a_400(make_cluster: Any) -> None:
    c = await make_cluster(1)
    r = await chat(c, "bad", [{"role": "user", "content": "x"}], reasoning_policy="summarise")
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_policy"
    assert await c.gateway.sessions.count() == 0
