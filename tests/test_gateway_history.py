"""Turn-scoped reasoning through the gateway: restoration, policies, and the loss explanation."""

from __future__ import annotations

import json
from typing import Any

import httpx

from tests.conftest import MODEL
from tests.helpers import TOOLS, chat, metric, ready


def reuse(r: httpx.Response) -> dict[str, str]:
    return dict(kv.split("=", 1) for kv in r.headers["x-kvgate-prefix-reuse"].split("; "))


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
    assert c.gateway.store.stats()["conversations"] == 0


async def test_stateful_continuation_rebuilds_history_and_guards_it(make_cluster: Any) -> None:
    c = await make_cluster(1, events=True)
    await ready(c)
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "agent " * 200}, {"role": "user", "content": "go"}]
    r1 = await chat(c, "sf", msgs, sim={"tool_calls": 1})
    rid = r1.json()["id"]
    call = r1.json()["choices"][0]["message"]["tool_calls"][0]
    # Only the new message: kvgate supplies the rest.
    r2 = await chat(c, "ignored-by-continuation", [{"role": "tool", "tool_call_id": call["id"], "content": "done"}],
                    previous_response_id=rid, sim={"tool_calls": 0})
    assert r2.status_code == 200, r2.text
    assert r2.headers["x-kvgate-conversation-source"] == "previous_response_id"
    usage = r2.json()["usage"]
    assert usage["prompt_tokens"] > r1.json()["usage"]["prompt_tokens"]
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 256  # the rebuilt history hit the cache
    # A resent history that disagrees with the stored one: 409 naming the first differing message.
    wrong = [msgs[0], {"role": "user", "content": "something else"}]
    r3 = await chat(c, "x", wrong, previous_response_id=r2.json()["id"])
    assert r3.status_code == 409 and r3.json()["error"]["param"] == "messages[1]"
    r4 = await chat(c, "x", [{"role": "user", "content": "hi"}], previous_response_id="chatcmpl-unknown")
    assert r4.status_code == 404 and r4.json()["error"]["param"] == "previous_response_id"


async def test_next_turn_prefix_is_what_the_next_request_starts_with(make_cluster: Any) -> None:
    c = await make_cluster(1, events=True)
    await ready(c)
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "agent " * 100}, {"role": "user", "content": "hi"}]
    r1 = await chat(c, "np", msgs, sim={"tool_calls": 0, "reasoning_tokens": 100})
    reply = {k: v for k, v in r1.json()["choices"][0]["message"].items() if v is not None}
    async with httpx.AsyncClient() as h:
        pre = (await h.get(c.url + "/admin/conversations/np/next-prefix")).json()
        nxt = [*msgs, reply, {"role": "user", "content": "and now?"}]
        tok = (await h.post(c.sims[0][1].url + "/tokenize", json={"model": MODEL, "messages": nxt,
                                                                  "tools": TOOLS})).json()["tokens"]
    assert pre["tokens"] > 100 and tok[: pre["tokens"]] == pre["token_ids"]
    # The Qwen3-style template drops this turn's reasoning once a user message follows: P|A, not P|R|A.
    assert pre["tokens"] < r1.json()["usage"]["prompt_tokens"] + r1.json()["usage"]["completion_tokens"]


async def test_renumbered_tool_call_ids_still_restore_the_exact_reply(make_cluster: Any) -> None:
    # A client that keeps its own tool-call ids (call_0, ...) and re-dumps the arguments in another key
    # order (issue 24): the reply is found by what its call means, and the cache holds.
    c = await make_cluster(1, events=True)
    await ready(c)
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "agent " * 200}, {"role": "user", "content": "go"}]
    r1 = await chat(c, "ids", msgs, sim={"tool_calls": [{"name": "search", "arguments": {"q": "kv cache", "k": 3}}]})
    m = r1.json()["choices"][0]["message"]
    args = json.loads(m["tool_calls"][0]["function"]["arguments"])
    echoed = {"role": "assistant", "content": None, "tool_calls": [{"id": "call_0", "type": "function", "function": {
        "name": "search", "arguments": json.dumps(dict(reversed(list(args.items()))))}}]}
    r2 = await chat(c, "ids", [*msgs, echoed, {"role": "tool", "tool_call_id": "call_0", "content": "found"}])
    assert r2.status_code == 200
    assert "restored=2" in r2.headers["x-kvgate-history"]  # the arguments and the omitted reasoning
    info = reuse(r2)
    assert info["cause"] in ("none", "block_alignment") and int(info["lost"]) < 128, info
    assert r2.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == int(info["expected"])
