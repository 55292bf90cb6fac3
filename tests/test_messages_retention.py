"""A request's ask to keep its KV (Anthropic ``cache_control``, OpenAI ``prompt_cache_retention``) reflected in
its conversation's reservation on the home worker after an answer: through the doors, on simulated workers."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest

from kvgate.router.types import ConversationId
from kvgate.session.state import LAPSE, Reservation
from tests.conftest import MODEL, Cluster
from tests.helpers import eventually, metric, ready

SYSTEM = "You are an agent. " * 40
ANSWER = {"tool_calls": 0}


def messages_body(mark: dict[str, Any] | None, stream: bool = False, **extra: Any) -> dict[str, Any]:
    system: dict[str, Any] = {"type": "text", "text": SYSTEM, **({"cache_control": mark} if mark else {})}
    return {"model": MODEL, "max_tokens": 64, "system": [system], "stream": stream, "sim": ANSWER,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "explain the failing test"}]}],
            **extra}


async def post(c: Cluster, path: str, conv: str, body: dict[str, Any], tenant: str | None = None) -> httpx.Response:
    headers = {"x-conversation-id": conv, **({"x-tenant-id": tenant} if tenant else {})}
    async with httpx.AsyncClient(timeout=30) as h:
        r = await h.post(c.url + path, json=body, headers=headers)
    assert r.status_code == 200, r.text
    return r


async def reservation(c: Cluster, cid: str) -> Reservation | None:
    conv = await c.gateway.store.get(ConversationId(cid))
    assert conv is not None
    return conv.session.reservation


async def reserved_tokens(c: Cluster) -> dict[str, int]:
    async with httpx.AsyncClient() as h:
        workers = (await h.get(c.url + "/admin/workers")).json()["workers"]
    return {w["id"]: w["reserved_tokens"] for w in workers}


def turns(c: Cluster, cid: str, n: int) -> Callable[[], Awaitable[bool]]:
    async def done() -> bool:
        conv = await c.gateway.store.get(ConversationId(cid))
        return conv is not None and conv.turn_count >= n

    return done


@pytest.mark.parametrize("stream", [False, True], ids=["create", "stream"])
async def test_a_marked_answer_is_reserved_on_its_home_worker_until_the_next_request(make_cluster: Any,
                                                                                      stream: bool) -> None:
    c = await make_cluster(2, events=True)
    await ready(c)
    before = time.time()
    r = await post(c, "/v1/messages", "marked", messages_body({"type": "ephemeral", "ttl": "1h"}, stream))
    home = r.headers["x-kvgate-worker"]

    await eventually(turns(c, "marked", 1))  # a stream is recorded once it ends
    res = await reservation(c, "marked")
    assert res is not None and res.worker == home
    assert before + 3600 <= res.until <= time.time() + 3600  # the 1 h ttl, within the default cap
    conv = await c.gateway.store.get(ConversationId("marked"))
    assert conv is not None and conv.session.timer(LAPSE) == res.token
    assert conv.session.lifecycle.state.value == "awaiting_user"
    last = conv.turns[-1]
    assert res.tokens == last.prompt_tokens + last.completion_tokens > 0
    assert (await reserved_tokens(c))[home] == res.tokens
    async with httpx.AsyncClient() as h:
        shown = (await h.get(c.url + "/admin/conversations/marked")).json()["reservation"]
    assert shown == {"worker": home, "tokens": res.tokens, "until": res.until}
    assert await metric(c, "kvgate_retentions_total", outcome="reserve") == 1

    # The same request unmarked, in another conversation: its KV is left to the engine.
    await post(c, "/v1/messages", "plain", messages_body(None, stream))
    await eventually(turns(c, "plain", 1))
    assert await reservation(c, "plain") is None
    assert sum((await reserved_tokens(c)).values()) == res.tokens

    # The user comes back: the next request releases what was kept (and asks for nothing this time).
    follow = messages_body(None, stream)
    follow["messages"] += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "and now?"}]
    await post(c, "/v1/messages", "marked", follow)
    await eventually(turns(c, "marked", 2))
    assert await reservation(c, "marked") is None
    assert all(n == 0 for n in (await reserved_tokens(c)).values())


async def test_an_unttled_marker_keeps_five_minutes_and_the_cap_bounds_a_longer_one(make_cluster: Any) -> None:
    c = await make_cluster(1, events=True, cache_control_max_retain_s=600)
    await ready(c)
    before = time.time()
    await post(c, "/v1/messages", "five", messages_body({"type": "ephemeral"}))
    res = await reservation(c, "five")
    assert res is not None and before + 300 <= res.until <= time.time() + 300
    # A tool block's 1 h marker is the longest one; the setting caps it at 10 minutes.
    tool = {"name": "search", "input_schema": {"type": "object"}, "cache_control": {"type": "ephemeral", "ttl": "1h"}}
    before = time.time()
    await post(c, "/v1/messages", "hour", messages_body({"type": "ephemeral"}, tools=[tool]))
    res = await reservation(c, "hour")
    assert res is not None and before + 600 <= res.until <= time.time() + 600


async def test_a_zero_cap_ignores_the_markers(make_cluster: Any) -> None:
    c = await make_cluster(1, events=True, cache_control_max_retain_s=0)
    await ready(c)
    await post(c, "/v1/messages", "off", messages_body({"type": "ephemeral", "ttl": "1h"}))
    assert await reservation(c, "off") is None
    assert sum((await reserved_tokens(c)).values()) == 0


async def test_a_marked_answer_over_the_tenants_parked_budget_is_not_reserved(make_cluster: Any) -> None:
    c = await make_cluster(1, events=True, admission={"enabled": True, "tenants": {"lean": {"max_parked_kv_tokens": 10},
                                                                                   "roomy": {}}})
    await ready(c)
    mark = {"type": "ephemeral", "ttl": "1h"}
    await post(c, "/v1/messages", "m", messages_body(mark), tenant="lean")
    assert await reservation(c, "lean/m") is None
    assert await metric(c, "kvgate_retentions_total", outcome="over_budget") == 1
    await post(c, "/v1/messages", "m", messages_body(mark), tenant="roomy")
    assert await reservation(c, "roomy/m") is not None
    assert await c.gateway.fleet.reserved_by("lean", 0.0) == 0 < await c.gateway.fleet.reserved_by("roomy", 0.0)


async def test_openais_24h_retention_is_kept_for_the_cap_at_the_chat_and_responses_doors(make_cluster: Any) -> None:
    c = await make_cluster(1, events=True, cache_control_max_retain_s=900)
    await ready(c)
    chat = {"model": MODEL, "sim": ANSWER, "messages": [{"role": "system", "content": SYSTEM},
                                                        {"role": "user", "content": "explain"}]}
    before = time.time()
    await post(c, "/v1/chat/completions", "chat-24h", {**chat, "prompt_cache_retention": "24h"})
    res = await reservation(c, "chat-24h")
    assert res is not None and before + 900 <= res.until <= time.time() + 900
    await post(c, "/v1/chat/completions", "chat-mem", {**chat, "prompt_cache_retention": "in_memory"})
    assert await reservation(c, "chat-mem") is None
    resp = {"model": MODEL, "sim": ANSWER, "instructions": SYSTEM, "input": "explain", "prompt_cache_retention": "24h"}
    await post(c, "/v1/responses", "resp-24h", resp)
    assert await reservation(c, "resp-24h") is not None
