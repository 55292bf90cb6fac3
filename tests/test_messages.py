"""The Anthropic Messages door end to end: the official ``anthropic`` client, the gateway, simulated workers."""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterator
from typing import Any

import anthropic
import httpx
import pytest

from tests.conftest import MODEL, Cluster
from tests.helpers import assert_losses_named, eventually

TOOLS: list[Any] = [{"name": "search", "description": "search the code",
                     "input_schema": {"type": "object", "properties": {"q": {"type": "string"}}}}]
SYSTEM = "You are an agent. " * 40
SIM = {"sim": {"tool_calls": 1, "reasoning_tokens": 30}}
THINKING: Any = {"type": "enabled", "budget_tokens": 1024}


def client(c: Cluster) -> anthropic.AsyncAnthropic:
    """One per cluster, closed with it (an unclosed SDK client's pool outlives the test's loop)."""
    ac = getattr(c, "_anthropic", None)
    if ac is None:
        ac = anthropic.AsyncAnthropic(base_url=c.url, api_key="unused", max_retries=0)
        c._anthropic = ac  # type: ignore[attr-defined]
    return ac


@pytest.fixture
async def make_cluster(make_cluster: Any) -> AsyncIterator[Any]:
    made: list[Cluster] = []

    async def make(*a: Any, **kw: Any) -> Cluster:
        made.append(await make_cluster(*a, **kw))
        return made[-1]

    yield make
    for c in made:
        if getattr(c, "_anthropic", None) is not None:
            await c._anthropic.close()  # type: ignore[attr-defined]


def _result(msg: anthropic.types.Message, i: int) -> dict[str, Any]:
    use = next(b for b in msg.content if b.type == "tool_use")
    return {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": f"result {i} " * 30}]}


async def _step(ac: anthropic.AsyncAnthropic, msgs: list[Any], headers: dict[str, str], stream: bool
                ) -> tuple[anthropic.types.Message, Any]:
    kw: dict[str, Any] = dict(model=MODEL, max_tokens=2048, system=SYSTEM, messages=msgs, tools=TOOLS,
                              thinking=THINKING, extra_headers=headers, extra_body=SIM)
    if stream:
        async with ac.messages.stream(**kw) as s:
            return await s.get_final_message(), s.response.headers
    raw = await ac.messages.with_raw_response.create(**kw)
    return await raw.parse(), raw.headers


async def run_loop(c: Cluster, steps: int, headers: dict[str, str], stream: bool = False
                   ) -> tuple[list[tuple[str, int, int, int]], list[Any]]:
    """A tool loop with thinking on, echoing every assistant turn's blocks (thinking with its signature)
    as the SDK returned them. Returns (worker, uncached input, cache reads, kvgate's expected) per step."""
    ac = client(c)
    msgs: list[Any] = [{"role": "user", "content": "fix the failing test"}]
    out = []
    convs: set[str] = set()
    for i in range(steps):
        msg, h = await _step(ac, msgs, headers, stream)
        assert msg.stop_reason == "tool_use"
        kinds = [b.type for b in msg.content]
        assert kinds[0] == "thinking" and "tool_use" in kinds
        assert msg.content[0].type == "thinking" and msg.content[0].signature and msg.content[0].thinking
        msgs += [{"role": "assistant", "content": msg.content}, _result(msg, i)]
        u = msg.usage
        out.append((h["x-kvgate-worker"], u.input_tokens, u.cache_read_input_tokens or 0,
                    int(h["x-kvgate-expected-cached-tokens"])))
        assert h["x-kvgate-conversation-source"] == "header:x-claude-code-session-id"
        convs.add(h["x-kvgate-conversation-id"])
    assert len(convs) == 1  # the session header alone names one conversation
    return out, msgs


@pytest.mark.parametrize("stream", [False, True], ids=["create", "stream"])
async def test_tool_loop_with_thinking_sticks_and_reuses_the_cache(make_cluster: Any, stream: bool) -> None:
    c = await make_cluster(3, events=True)  # precise mode: kvgate's expectation is exact
    await eventually(lambda: len(c.gateway.prefix.events.workers()) == 3)
    steps, _ = await run_loop(c, 4, {"x-claude-code-session-id": "cc-session-1"}, stream)
    assert len({w for w, _, _, _ in steps}) == 1
    cached = [r for _, _, r, _ in steps]
    assert cached[0] == 0 and all(b > a for a, b in itertools.pairwise(cached)), cached
    assert all(read == expected for _, _, read, expected in steps), steps
    # The echoed thinking reached the engine byte-exact: only the new tool result and the last partial
    # block of the history are prefilled again.
    for _, uncached, _, _ in steps[1:]:
        assert uncached < 128 + 60 + 40, steps
    await assert_losses_named(c, "cc-session-1")


async def test_tampered_signature_is_refused_in_anthropics_shape(make_cluster: Any) -> None:
    c = await make_cluster(1)
    _, msgs = await run_loop(c, 1, {"x-claude-code-session-id": "cc-tamper"})
    block = msgs[1]["content"][0].model_dump()
    for bad in ({**block, "thinking": block["thinking"] + " (edited)"}, {**block, "signature": "kvg1.forged"}):
        tampered = [msgs[0], {"role": "assistant", "content": [bad, *msgs[1]["content"][1:]]}, msgs[2]]
        with pytest.raises(anthropic.BadRequestError) as ei:
            await client(c).messages.create(model=MODEL, max_tokens=2048, messages=tampered, tools=TOOLS,
                                            thinking=THINKING, extra_body=SIM)
        assert ei.value.status_code == 400
        assert ei.value.body == {"type": "error", "error": {
            "type": "invalid_request_error",
            "message": "messages.1.content.0: Invalid `signature` in `thinking` block"}}


async def test_omitted_thinking_is_restored_from_the_record(make_cluster: Any) -> None:
    """A client that drops its thinking blocks in the tool loop: kvgate puts the engine's reasoning back,
    so the prefix still matches the cache."""
    c = await make_cluster(1, events=True)
    await eventually(lambda: len(c.gateway.prefix.events.workers()) == 1)
    _, msgs = await run_loop(c, 1, {"x-claude-code-session-id": "cc-omit"})
    msgs[1] = {"role": "assistant", "content": [b for b in msgs[1]["content"] if b.type != "thinking"]}
    msg, h = await _step(client(c), msgs, {"x-claude-code-session-id": "cc-omit"}, False)
    assert "restored=1" in h["x-kvgate-history"]
    assert msg.usage.cache_read_input_tokens == int(h["x-kvgate-expected-cached-tokens"]) > 0
    assert msg.usage.input_tokens < 128 + 60 + 40


async def test_thinking_across_user_turns_follows_the_reasoning_policy(make_cluster: Any) -> None:
    """The completed turn's thinking blocks still verify; the policy (drop) keeps them out of the prompt."""
    c = await make_cluster(1, reasoning_policy="drop")
    _, msgs = await run_loop(c, 2, {"x-claude-code-session-id": "cc-turns"})
    msgs.append({"role": "user", "content": "now explain what you changed"})
    raw = await client(c).messages.with_raw_response.create(
        model=MODEL, max_tokens=2048, messages=msgs, tools=TOOLS, thinking=THINKING,
        extra_headers={"x-claude-code-session-id": "cc-turns"},
        extra_body={"sim": {"reasoning_tokens": 10, "tool_calls": 0}})
    assert (await raw.parse()).stop_reason == "end_turn"
    assert raw.headers["x-kvgate-history"].startswith("policy=drop") and "reasoning_changed=2" in raw.headers[
        "x-kvgate-history"]


async def test_count_tokens_is_the_rendered_prompt(make_cluster: Any) -> None:
    c = await make_cluster(1)
    ac = client(c)
    msgs: list[Any] = [{"role": "user", "content": [{"type": "text", "text": "hello"},
                                                    {"type": "text", "text": "world", "cache_control": {
                                                        "type": "ephemeral"}}]}]
    counted = await ac.messages.count_tokens(model=MODEL, system=[{"type": "text", "text": SYSTEM}], messages=msgs,
                                             tools=TOOLS)
    r = await ac.messages.create(model=MODEL, max_tokens=16, system=[{"type": "text", "text": SYSTEM}],
                                 messages=msgs, tools=TOOLS)
    assert counted.input_tokens > 100
    assert counted.input_tokens == r.usage.input_tokens + (r.usage.cache_read_input_tokens or 0)
    with pytest.raises(anthropic.NotFoundError) as ei:
        await ac.messages.count_tokens(model="nope", messages=msgs)
    assert ei.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]


async def test_plain_answer_usage_stop_sequence_and_shape(make_cluster: Any) -> None:
    c = await make_cluster(1)
    ac = client(c)
    r = await ac.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "hi"}],
                                 thinking={"type": "disabled"}, stop_sequences=["never-matched"],
                                 metadata={"user_id": "u-1"},
                                 # SDK 2.x dropped the sampling parameters from create(); the API still takes them.
                                 extra_body={"temperature": 0.5, "top_p": 0.9, "top_k": 5})
    assert r.type == "message" and r.role == "assistant" and r.id.startswith("msg_")
    assert [b.type for b in r.content] == ["text"]  # thinking disabled: the template skips reasoning
    assert r.stop_reason in ("end_turn", "max_tokens")
    assert r.usage.input_tokens > 0 and r.usage.output_tokens > 0 and r.usage.cache_creation_input_tokens == 0
    events = []
    async with ac.messages.stream(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "hi"}],
                                  extra_body={"sim": {"reasoning_tokens": 3, "answer_tokens": 20}}) as s:
        async for ev in s:
            events.append(ev.type)
        final = await s.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop" and "message_delta" in events
    assert final.stop_reason == "max_tokens"
    assert final.usage.input_tokens > 0 and final.usage.output_tokens == 4


async def test_errors_are_in_anthropics_shape(make_cluster: Any) -> None:
    c = await make_cluster(1)
    ac = client(c)
    with pytest.raises(anthropic.NotFoundError) as nf:
        await ac.messages.create(model="nope", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    assert nf.value.body["type"] == "error" and nf.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    async with httpx.AsyncClient(base_url=c.url) as h:
        for body, needle in [
            ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
            ({"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]},
             "`image` content blocks are not supported"),
            ({"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "x"}]}]}, "corresponding `tool_use`"),
            ({"model": MODEL, "max_tokens": 8, "n": 2, "messages": [{"role": "user", "content": "hi"}]}, "n:"),
        ]:
            r = await h.post("/v1/messages", json=body)
            assert r.status_code == 400, r.text
            assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
            assert needle in r.json()["error"]["message"]


async def test_no_healthy_worker_is_overloaded_error(make_cluster: Any) -> None:
    c = await make_cluster(1)
    for _, h in c.sims:
        await h.stop()
    async with httpx.AsyncClient(base_url=c.url) as h:
        for _ in range(50):  # until the health check marks the worker down
            r = await h.post("/v1/messages", json={"model": MODEL, "max_tokens": 8,
                                                   "messages": [{"role": "user", "content": "hi"}]})
            if r.status_code == 503:
                break
    assert r.status_code == 503, r.text
    assert r.json()["error"]["type"] == "overloaded_error"


async def test_the_sdks_x_api_key_authenticates_and_a_bad_one_is_authentication_error(make_cluster: Any) -> None:
    from kvgate.gateway.auth import key_hash

    keys = [{"sha256": key_hash("key-a"), "tenant": "A", "role": "tenant", "name": "a"}]
    c = await make_cluster(1, auth={"mode": "api_key", "api_keys": keys, "cache_salt_secret": "salt-secret"})
    kw: dict[str, Any] = dict(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    async with anthropic.AsyncAnthropic(base_url=c.url, api_key="key-a", max_retries=0) as ok:
        r = await ok.messages.create(**kw)
        counted = await ok.messages.count_tokens(model=MODEL, messages=kw["messages"])
    assert r.content and counted.input_tokens > 0
    async with anthropic.AsyncAnthropic(base_url=c.url, api_key="wrong", max_retries=0) as bad:
        with pytest.raises(anthropic.AuthenticationError) as ei:
            await bad.messages.create(**kw)
        with pytest.raises(anthropic.AuthenticationError):
            await bad.messages.count_tokens(model=MODEL, messages=kw["messages"])
    assert ei.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]


async def test_the_configured_secret_signs(make_cluster: Any) -> None:
    """With ``thinking_signature_secret`` set, a block signed under the built-in key is refused."""
    from kvgate.fronts.messages.signing import Signer

    c = await make_cluster(1, thinking_signature_secret="deployment-key")
    msgs: list[Any] = [{"role": "user", "content": "hi"},
                       {"role": "assistant", "content": [{"type": "thinking", "thinking": "t", "signature": ""},
                                                         {"type": "text", "text": "ok"}]},
                       {"role": "user", "content": "again"}]
    for key, status in ((None, 400), (b"deployment-key", 200)):
        msgs[1]["content"][0]["signature"] = Signer(key).sign("t")
        async with httpx.AsyncClient(base_url=c.url) as h:
            r = await h.post("/v1/messages", json={"model": MODEL, "max_tokens": 8, "messages": msgs})
        assert r.status_code == status, r.text


async def test_cache_control_markers_are_accepted_and_leave_the_prompt_as_it_is(make_cluster: Any) -> None:
    """Claude Code marks its system prompt, tools and latest message with ``cache_control``: accepted on every
    block kind and at the top level, and the prompt is the same tokens as without them (docs/protocols.md)."""
    c = await make_cluster(1, events=True)
    await eventually(lambda: len(c.gateway.prefix.events.workers()) == 1)
    mark: Any = {"type": "ephemeral", "ttl": "1h"}
    _, msgs = await run_loop(c, 1, {"x-claude-code-session-id": "cc-marks"})
    plain: dict[str, Any] = dict(model=MODEL, system=[{"type": "text", "text": SYSTEM}], messages=msgs, tools=TOOLS)
    marked: dict[str, Any] = dict(
        model=MODEL, system=[{"type": "text", "text": SYSTEM, "cache_control": mark}],
        tools=[{**TOOLS[0], "cache_control": mark}],
        messages=[msgs[0], msgs[1], {"role": "user", "content": [{**msgs[2]["content"][0], "cache_control": mark}]}])
    ac = client(c)
    counted = [(await ac.messages.count_tokens(**kw)).input_tokens for kw in (marked, plain)]
    assert counted[0] == counted[1]
    raw = await ac.messages.with_raw_response.create(
        max_tokens=2048, thinking=THINKING, extra_body={**SIM, "cache_control": mark},
        extra_headers={"x-claude-code-session-id": "cc-marks"}, **marked)
    msg = await raw.parse()
    # The marked request continues the unmarked chain: its cache reads are what kvgate expected.
    assert msg.usage.cache_read_input_tokens == int(raw.headers["x-kvgate-expected-cached-tokens"]) > 0
    assert msg.usage.cache_creation_input_tokens == 0


@pytest.mark.parametrize("stream", [False, True], ids=["create", "stream"])
async def test_the_sdks_tool_runner_falls_back_from_message_threads(make_cluster: Any, stream: bool) -> None:
    """``client.beta.messages.tool_runner`` sends ``thread`` (the message-threads beta: history kept on the
    server, only new messages sent). kvgate refuses it as Anthropic refuses a request it cannot thread, the
    SDK resends the whole history unthreaded, and the loop runs on one worker with the cache growing."""
    c = await make_cluster(3, events=True)
    await eventually(lambda: len(c.gateway.prefix.events.workers()) == 3)
    calls: list[str] = []

    @anthropic.beta_async_tool
    async def search(query: str, step: int = 0) -> str:
        """Search the code.

        Args:
            query: what to look for
            step: which step of the search
        """
        calls.append(query)
        return f"found {query} in store.py " * 20

    sent: list[dict[str, Any]] = []
    seen: list[tuple[int, Any]] = []

    async def keep(request: Any) -> None:
        sent.append(json.loads(request.content))

    async def answered(response: Any) -> None:
        seen.append((response.status_code, response.headers))

    http = anthropic.DefaultAsyncHttpxClient(event_hooks={"request": [keep], "response": [answered]})
    async with anthropic.AsyncAnthropic(base_url=c.url, api_key="unused", max_retries=0, http_client=http) as ac:
        kw: dict[str, Any] = dict(model=MODEL, max_tokens=2048, system=SYSTEM, tools=[search], thinking=THINKING,
                                  messages=[{"role": "user", "content": "fix the failing test"}],
                                  extra_headers={"x-claude-code-session-id": f"cc-runner-{stream}"})
        if stream:
            replies = [await s.get_final_message() async for s in ac.beta.messages.tool_runner(stream=True, **kw)]
        else:
            replies = [m async for m in ac.beta.messages.tool_runner(**kw)]
    assert [m.stop_reason for m in replies] == ["tool_use", "end_turn"] and len(calls) == 1
    assert "thread" in sent[0] and seen[0][0] == 400  # refused once, then never sent again
    assert all("thread" not in b for b in sent[1:]) and [s for s, _ in seen[1:]] == [200, 200]
    assert len(sent[2]["messages"]) == 3  # the whole history: user, assistant (thinking, tool_use), tool_result
    ok = [h for _, h in seen[1:]]
    assert len({h["x-kvgate-worker"] for h in ok}) == 1
    cached = [m.usage.cache_read_input_tokens or 0 for m in replies]
    assert cached == [int(h["x-kvgate-expected-cached-tokens"]) for h in ok] and cached[0] == 0 < cached[1]
    await assert_losses_named(c, f"cc-runner-{stream}")
