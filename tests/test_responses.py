"""The Responses door end to end: the official openai client (``client.responses``), the gateway and
simulated workers on loopback."""

from __future__ import annotations

import itertools
import json
import uuid
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import MODEL, Cluster
from tests.helpers import assert_losses_named

TOOLS: list[Any] = [{"type": "function", "name": "search", "description": "search the code",
                     "parameters": {"type": "object", "properties": {"query": {"type": "string"}}}}]
INSTRUCTIONS = "You are an agent. " * 40


def client(c: Cluster, url: str | None = None, **kw: Any) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=(url or c.url) + "/v1", api_key="unused", max_retries=0, **kw)


def cached_of(r: Any) -> int:
    return int(r.usage.input_tokens_details.cached_tokens)


async def tool_loop(oc: openai.AsyncOpenAI, steps: int, *, stream: bool = False, headers: dict[str, str] | None = None,
                    clients: list[openai.AsyncOpenAI] | None = None) -> list[tuple[str, int, int, int, Any]]:
    """An agent on previous_response_id: every step calls the tool, the next sends only its output.
    Returns (worker, input tokens, cached tokens, kvgate's expected cached tokens, response) per step."""
    out = []
    prev: str | None = None
    new_input: Any = "find the cache bug"
    for i in range(steps):
        c = clients[i % len(clients)] if clients else oc
        kw: dict[str, Any] = dict(model=MODEL, input=new_input, instructions=INSTRUCTIONS, tools=TOOLS,
                                  extra_body={"sim": {"tool_calls": 1, "reasoning_tokens": 30}},
                                  extra_headers=headers or {})
        if prev is not None:
            kw["previous_response_id"] = prev
        if stream:
            async with c.responses.with_streaming_response.create(stream=True, **kw) as raw:
                events = [json.loads(line[5:]) async for line in raw.iter_lines() if line.startswith("data:")]
                hdrs = raw.headers
            r = openai.types.responses.Response.model_validate(events[-1]["response"])
            assert events[-1]["type"] == "response.completed"
            assert [e["sequence_number"] for e in events] == list(range(len(events)))
        else:
            raw_resp = await c.responses.with_raw_response.create(**kw)
            r, hdrs = raw_resp.parse(), raw_resp.headers
        calls = [o for o in r.output if o.type == "function_call"]
        assert calls, "the scripted agent calls a tool every step"
        assert r.usage is not None
        out.append((hdrs["x-kvgate-worker"], r.usage.input_tokens, cached_of(r),
                    int(hdrs["x-kvgate-expected-cached-tokens"]), r))
        prev = r.id
        new_input = [{"type": "function_call_output", "call_id": calls[0].call_id, "output": f"result {i} " * 30}]
    return out


def assert_one_worker_growing(turns: list[tuple[str, int, int, int, Any]]) -> None:
    print("input/cached/expected per step:", [(p, ct, e) for _, p, ct, e, _ in turns])
    assert len({w for w, *_ in turns}) == 1
    cached = [ct for _, _, ct, _, _ in turns]
    assert cached[0] == 0 and all(b > a for a, b in itertools.pairwise(cached)), cached
    for _, _, ct, expected, _ in turns:
        assert ct == expected, (ct, expected)  # kvgate's expected == the engine's reported, every request
    for _, prompt, ct, _, _ in turns[1:]:
        assert prompt - ct < 128 + 40 + 60  # inside a tool chain nothing is dropped


@pytest.mark.parametrize("stream", [False, True])
async def test_tool_loop_on_previous_response_id(make_cluster: Any, stream: bool) -> None:
    c = await make_cluster(3, events=True)
    turns = await tool_loop(client(c), 4, stream=stream, headers={"x-conversation-id": f"resp-loop-{stream}"})
    assert_one_worker_growing(turns)
    await assert_losses_named(c, f"resp-loop-{stream}")
    r = turns[-1][4]
    kinds = [o.type for o in r.output]
    assert kinds[0] == "reasoning" and kinds[-1] == "function_call"
    assert r.output[0].content[0].text  # the reasoning as reasoning_text
    assert r.id.startswith("resp_") and r.previous_response_id == turns[-2][4].id


async def test_stateless_tool_loop_resends_output_items(make_cluster: Any) -> None:
    """store: false, the whole input resent each step (reasoning items, function calls, outputs), as the
    Agents SDK and Codex do without server state: still one worker, growing cache, expected == reported."""
    c = await make_cluster(3, events=True)
    oc = client(c)
    items: list[Any] = [{"role": "user", "content": "find the cache bug"}]
    turns = []
    for i in range(4):
        raw = await oc.responses.with_raw_response.create(
            model=MODEL, input=items, instructions=INSTRUCTIONS, tools=TOOLS, store=False,
            extra_body={"sim": {"tool_calls": 1, "reasoning_tokens": 30}}, extra_headers={"x-session-id": "agent-sl"})
        r = raw.parse()
        turns.append((raw.headers["x-kvgate-worker"], r.usage.input_tokens, cached_of(r),  # type: ignore[union-attr]
                      int(raw.headers["x-kvgate-expected-cached-tokens"]), r))
        items += [o.model_dump(exclude_none=True) for o in r.output]
        call = next(o for o in r.output if o.type == "function_call")
        items.append({"type": "function_call_output", "call_id": call.call_id, "output": f"result {i} " * 30})
    assert_one_worker_growing(turns)
    await assert_losses_named(c, "agent-sl")
    # store: false keeps nothing: not retrievable, not continuable.
    for _, _, _, _, r in turns:
        with pytest.raises(openai.NotFoundError):
            await oc.responses.retrieve(r.id)
        with pytest.raises(openai.NotFoundError):
            await oc.responses.create(model=MODEL, input="go on", previous_response_id=r.id)


async def test_store_false_records_no_response_id(make_cluster: Any) -> None:
    c = await make_cluster(1)
    oc = client(c)
    raw = await oc.responses.with_raw_response.create(model=MODEL, input="hello", store=False,
                                                      extra_headers={"x-conversation-id": "nostore"})
    async with httpx.AsyncClient() as h:
        conv = (await h.get(c.url + "/admin/conversations/nostore")).json()
    assert conv["responses"] == [] and conv["turns"]  # the turn is recorded (routing), no response id is
    with pytest.raises(openai.NotFoundError):
        await oc.responses.input_items.list(raw.parse().id)


async def test_retrieve_input_items_delete(make_cluster: Any) -> None:
    c = await make_cluster(1)
    oc = client(c)
    r = await oc.responses.create(model=MODEL, input=[{"role": "user", "content": "hello"}], metadata={"k": "v"},
                                  temperature=0.5, max_output_tokens=50)
    got = await oc.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump() and got.metadata == {"k": "v"} and got.temperature == 0.5
    items = await oc.responses.input_items.list(r.id)
    assert [i.type for i in items.data] == ["message"]
    assert items.data[0].content[0].text == "hello"  # type: ignore[union-attr,index]
    await oc.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        await oc.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):  # deleted: not continuable either
        await oc.responses.create(model=MODEL, input="more", previous_response_id=r.id)
    with pytest.raises(openai.NotFoundError):
        await oc.responses.delete(r.id)


async def test_another_tenants_response_is_404(make_cluster: Any) -> None:
    c = await make_cluster(1)
    a = client(c, default_headers={"x-tenant-id": "acme"})
    b = client(c, default_headers={"x-tenant-id": "umbrella"})
    r = await a.responses.create(model=MODEL, input="secret plans")
    for call in (lambda: b.responses.retrieve(r.id), lambda: b.responses.input_items.list(r.id),
                 lambda: b.responses.delete(r.id),
                 lambda: b.responses.create(model=MODEL, input="and then?", previous_response_id=r.id)):
        with pytest.raises(openai.NotFoundError) as e:
            await call()
        assert e.value.body["type"] == "not_found_error"  # type: ignore[index]
    assert (await a.responses.retrieve(r.id)).id == r.id
    assert (await a.responses.create(model=MODEL, input="and then?", previous_response_id=r.id)).output


async def test_continues_on_another_replica(make_cluster: Any) -> None:
    c = await make_cluster(3, events=True, replicas=3, session_store="redis",
                           redis_prefix=f"kvgate-test-resp-{uuid.uuid4().hex[:8]}:")
    clients = [client(c, url=h.url) for h in c.replicas]
    turns = await tool_loop(clients[0], 4, clients=clients)  # each step on the next replica
    assert_one_worker_growing(turns)
    last = turns[-1][4]
    for oc in clients:  # stored in Redis: every replica retrieves it
        assert (await oc.responses.retrieve(last.id)).id == last.id


async def test_streaming_event_sequence(make_cluster: Any) -> None:
    c = await make_cluster(1)
    oc = client(c)
    stream = await oc.responses.create(model=MODEL, input="hello", tools=TOOLS, stream=True,
                                       extra_body={"sim": {"tool_calls": 1, "reasoning_tokens": 8,
                                                           "answer_tokens": 5}})
    events = [e async for e in stream]  # parsed by the SDK into its event types
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    for item in ("reasoning_text", "output_text"):
        i = list[str](kinds).index(f"response.{item}.delta")
        assert kinds[i - 2:i] == ["response.output_item.added", "response.content_part.added"]
        assert f"response.{item}.done" in kinds
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == 3
    done = events[-1].response  # type: ignore[union-attr]
    assert [o.type for o in done.output] == ["reasoning", "message", "function_call"]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert done.output[1].content[0].text == text  # type: ignore[union-attr,index]
    assert done.usage is not None and done.usage.output_tokens > 0
    assert (await oc.responses.retrieve(done.id)).output == done.output


async def test_stream_helper_and_output_text(make_cluster: Any) -> None:
    c = await make_cluster(1)
    async with client(c).responses.stream(model=MODEL, input="hello") as s:
        async for _ in s:
            pass
        final = await s.get_final_response()
    assert final.output_text and final.status == "completed"


async def test_errors_in_openai_shape(make_cluster: Any) -> None:
    c = await make_cluster(1)
    oc = client(c)
    with pytest.raises(openai.BadRequestError) as e:
        await oc.responses.create(model=MODEL, input="x", tools=[{"type": "web_search"}])
    assert e.value.body["param"] == "tools[0].type"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as e:
        await oc.responses.create(model=MODEL, input=[{"type": "function_call_output", "call_id": "call_nope",
                                                       "output": "42"}])
    assert e.value.body["code"] == "unknown_call_id"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError):
        await oc.responses.create(model=MODEL, input=[
            {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "gAAAA..."},
            {"role": "user", "content": "hi"}])
    with pytest.raises(openai.NotFoundError):
        await oc.responses.create(model="no-such-model", input="x")
    with pytest.raises(openai.NotFoundError):
        await oc.responses.create(model=MODEL, input="x", previous_response_id="resp_chatcmpl-nope")


async def test_branching_from_an_earlier_response_is_409(make_cluster: Any) -> None:
    c = await make_cluster(1)
    oc = client(c)
    first = await oc.responses.create(model=MODEL, input="one")
    await oc.responses.create(model=MODEL, input="two", previous_response_id=first.id)
    with pytest.raises(openai.ConflictError):
        await oc.responses.create(model=MODEL, input="two again", previous_response_id=first.id)


async def test_memory_store_read_keeps_response_index() -> None:
    """A read of a conversation (the Responses door reads it to check call ids before the pipeline
    continues it) must not take its response ids out of the index (79514dc did: 404 on the next step)."""
    from kvgate.clock import MonotonicClock
    from kvgate.kvstore.conversations import MemoryConversationStore
    from kvgate.router.types import ConversationId
    from kvgate.session.conversation import Conversation

    s = MemoryConversationStore(MonotonicClock())
    cid = ConversationId("c1")
    await s.update(cid, lambda cur: Conversation(cid, responses=("chatcmpl-1",)))
    assert await s.get(cid) is not None
    assert await s.conversation_of("chatcmpl-1") == cid


async def test_chat_store_false_is_not_continuable(make_cluster: Any) -> None:
    """The chat door's own ``store: false``: no response id recorded, so previous_response_id is 404."""
    c = await make_cluster(1)
    oc = client(c)
    r = await oc.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], store=False)
    with pytest.raises(openai.NotFoundError):
        await oc.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "more"}],
                                         extra_body={"previous_response_id": r.id})
    kept = await oc.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert (await oc.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "more"}],
                                             extra_body={"previous_response_id": kept.id})).choices


async def test_response_store_bounds() -> None:
    """Over 1 MiB: not kept (the response was answered); another tenant reads nothing; the TTL ends it."""
    from kvgate.clock import VirtualClock
    from kvgate.fronts.responses.store import MAX_RESPONSE_BYTES, MemoryResponseStore, Stored

    clock = VirtualClock()
    s = MemoryResponseStore(clock, ttl_s=10, max_total_bytes=4 * MAX_RESPONSE_BYTES)
    assert not await s.put("resp_big", Stored("t", {"id": "resp_big"}, [{"text": "x" * MAX_RESPONSE_BYTES}]))
    assert await s.get("resp_big", "t") is None
    assert await s.put("resp_a", Stored("t", {"id": "resp_a"}, []))
    assert await s.get("resp_a", "other") is None and not await s.delete("resp_a", "other")
    assert (await s.get("resp_a", "t")) is not None
    clock.advance_to(11)
    assert await s.get("resp_a", "t") is None


@pytest.mark.parametrize("stream", [False, True])
async def test_length_is_incomplete(make_cluster: Any, stream: bool) -> None:
    c = await make_cluster(1)
    oc = client(c)
    kw: dict[str, Any] = dict(model=MODEL, input="hello", max_output_tokens=3,
                              extra_body={"sim": {"reasoning_tokens": 0, "answer_tokens": 50}})
    if stream:
        events = [e async for e in await oc.responses.create(stream=True, **kw)]
        assert events[-1].type == "response.incomplete"
        r = events[-1].response
    else:
        r = await oc.responses.create(**kw)
    assert r.status == "incomplete" and r.incomplete_details is not None
    assert r.incomplete_details.reason == "max_output_tokens" and r.usage is not None and r.usage.output_tokens == 3


async def test_stream_lost_mid_way_is_response_failed() -> None:
    """The relay's error event (a worker lost mid-stream) after some output: response.failed, not
    response.completed, and nothing is kept."""
    from collections.abc import AsyncIterator

    from kvgate.fronts.responses.stream import translate_stream
    from kvgate.fronts.responses.translate import read_request
    from kvgate.gateway.sse import error_event

    async def chat() -> AsyncIterator[bytes]:
        yield b'data: {"id": "chatcmpl-1", "choices": [{"index": 0, "delta": {"content": "Hel"}}]}\n\n'
        yield error_event("worker w1 failed mid-stream: reset")

    kept: list[Any] = []

    async def done(resp: dict[str, Any]) -> None:
        kept.append(resp)

    out = [json.loads(b.split(b"data: ", 1)[1]) async for b in
           translate_stream(chat(), read_request({"model": MODEL, "input": "hi"}), 0.0, done)]
    kinds = [e["type"] for e in out]
    assert kinds[-1] == "response.failed" and "response.completed" not in kinds and not kept
    assert out[-1]["response"]["output"][0]["content"][0]["text"] == "Hel"
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
