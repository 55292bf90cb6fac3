"""The Messages door's pure translation: requests into chat bodies, chat answers and streams back, read with
the official SDK's own types and stream accumulator (the ground truth for the wire format)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import Message

from kvgate.errors import BadRequest
from kvgate.fronts.messages import stream, translate
from kvgate.fronts.messages.signing import Signer

S = Signer(b"k")


def test_blocks_become_chat_messages_in_order() -> None:
    sig = S.sign("think")
    body: dict[str, Any] = {
        "model": "m", "max_tokens": 2000, "system": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
        "thinking": {"type": "enabled", "budget_tokens": 1024}, "sim": {"tool_calls": 1}, "stream": True,
        "stop_sequences": ["END"], "top_k": 3, "metadata": {"user_id": "u"}, "service_tier": "auto",
        "tools": [{"name": "f", "input_schema": {"type": "object"}, "cache_control": {"type": "ephemeral"}}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "messages": [
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": [
                {"type": "redacted_thinking", "data": "opaque"},
                {"type": "thinking", "thinking": "think", "signature": sig},
                {"type": "text", "text": "x", "cache_control": {"type": "ephemeral"}},
                {"type": "tool_use", "id": "t1", "name": "f", "input": {"é": 1}},
                {"type": "tool_use", "id": "t2", "name": "g", "input": {}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t2", "content": [{"type": "text", "text": "r2"}]},
                {"type": "tool_result", "tool_use_id": "t1", "content": "bad", "is_error": True},
                {"type": "text", "text": "next"}]}]}
    chat = translate.to_chat(body, S)
    assert chat["messages"] == [
        {"role": "system", "content": "a\nb"},
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "x", "reasoning": "think", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "f", "arguments": '{"é": 1}'}},
            {"id": "t2", "type": "function", "function": {"name": "g", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "t2", "content": "r2"},
        {"role": "tool", "tool_call_id": "t1", "content": "Error: bad"},
        {"role": "user", "content": "next"}]
    assert chat["tools"] == [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert chat["tool_choice"] == "required" and chat["parallel_tool_calls"] is False
    assert chat["chat_template_kwargs"] == {"enable_thinking": True}
    assert chat["stop"] == ["END"] and chat["top_k"] == 3 and chat["sim"] == {"tool_calls": 1}
    assert chat["stream_options"] == {"include_usage": True} and chat["metadata"] == {"user_id": "u"}
    assert "service_tier" not in chat and "max_tokens" in chat


@pytest.mark.parametrize("choice,want", [
    ({"type": "auto"}, {"tool_choice": "auto"}), ({"type": "none"}, {"tool_choice": "none"}),
    ({"type": "tool", "name": "f"}, {"tool_choice": {"type": "function", "function": {"name": "f"}}})])
def test_tool_choice(choice: dict[str, Any], want: dict[str, Any]) -> None:
    chat = translate.to_chat({"model": "m", "max_tokens": 5, "tool_choice": choice,
                              "messages": [{"role": "user", "content": "x"}]}, S)
    assert {k: chat[k] for k in want} == want


@pytest.mark.parametrize("body,needle", [
    ({"messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
    ({"max_tokens": 5, "thinking": {"type": "enabled", "budget_tokens": 1024}, "messages": [
        {"role": "user", "content": "x"}]}, "greater than `thinking.budget_tokens`"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "x", "signature": Signer(b"other").sign("x")}]},
        {"role": "user", "content": "y"}]}, "Invalid `signature` in `thinking` block"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "x"}]}, {"role": "user", "content": "y"}]}, "signature"),
])
def test_refusals(body: dict[str, Any], needle: str) -> None:
    with pytest.raises(BadRequest) as ei:
        translate.to_chat({"model": "m", **body}, S)
    assert needle in ei.value.message


def test_answer_and_usage_as_anthropic_counts() -> None:
    chat = {"id": "chatcmpl-1", "model": "m", "choices": [{"index": 0, "finish_reason": "stop", "stop_reason": "END",
                                                            "message": {"role": "assistant", "content": "hi",
                                                                        "reasoning": "r"}}],
            "usage": {"prompt_tokens": 100, "completion_tokens": 7, "prompt_tokens_details": {"cached_tokens": 64}}}
    msg = Message.model_validate(translate.from_chat(chat, S))
    assert [b.type for b in msg.content] == ["thinking", "text"]
    assert msg.content[0].type == "thinking" and S.verify("r", msg.content[0].signature)
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == "END"
    assert (msg.usage.input_tokens, msg.usage.cache_read_input_tokens, msg.usage.cache_creation_input_tokens,
            msg.usage.output_tokens) == (36, 64, 0, 7)


def _chunks(*objs: Any) -> AsyncIterator[bytes]:
    async def gen() -> AsyncIterator[bytes]:
        for o in objs:
            yield b"data: " + (o if isinstance(o, bytes) else json.dumps(o).encode()) + b"\n\n"
    return gen()


def _d(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {"id": "chatcmpl-9", "model": "m", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


async def _events(chunks: AsyncIterator[bytes]) -> list[tuple[str, dict[str, Any]]]:
    out = []
    async for raw in stream.translate(chunks, S):
        head, data = raw.decode().rstrip("\n").split("\n")
        out.append((head.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


async def test_stream_events_accumulate_in_the_sdk() -> None:
    evs = await _events(_chunks(
        _d({"role": "assistant"}), _d({"reasoning": "let me "}), _d({"reasoning": "see"}), _d({"content": "ok"}),
        _d({"tool_calls": [{"index": 0, "id": "c1", "type": "function", "function": {"name": "f", "arguments": ""}}]}),
        _d({"tool_calls": [{"index": 0, "function": {"arguments": '{"a": '}}]}),
        _d({"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]}), _d({}, "tool_calls"),
        {"id": "chatcmpl-9", "model": "m", "choices": [],
         "usage": {"prompt_tokens": 50, "completion_tokens": 9, "prompt_tokens_details": {"cached_tokens": 32}}},
        b"[DONE]"))
    kinds = [k for k, _ in evs]
    assert kinds[:2] == ["message_start", "ping"] and kinds[-2:] == ["message_delta", "message_stop"]
    sig = [d for k, d in evs if k == "content_block_delta" and d["delta"]["type"] == "signature_delta"]
    assert len(sig) == 1 and kinds[kinds.index("content_block_delta") + 2] == "content_block_delta"
    snap = None
    bufs: dict[int, bytes] = {}
    for k, d in evs:
        if k != "ping":
            snap = accumulate_event(event=d, current_snapshot=snap, json_bufs=bufs)  # type: ignore[arg-type]
    assert snap is not None
    assert [b.type for b in snap.content] == ["thinking", "text", "tool_use"]
    assert snap.content[0].type == "thinking" and snap.content[0].thinking == "let me see"
    assert S.verify("let me see", snap.content[0].signature)
    assert snap.content[2].type == "tool_use" and snap.content[2].input == {"a": 1} and snap.content[2].id == "c1"
    assert snap.stop_reason == "tool_use"
    assert (snap.usage.input_tokens, snap.usage.cache_read_input_tokens, snap.usage.output_tokens) == (18, 32, 9)


async def test_a_worker_lost_mid_stream_is_an_error_event() -> None:
    evs = await _events(_chunks(_d({"content": "par"}), {"error": {"message": "worker w failed mid-stream",
                                                                   "type": "upstream_error", "code": 502}}))
    assert evs[-1] == ("error", {"type": "error", "error": {"type": "api_error",
                                                            "message": "worker w failed mid-stream"}})
    cut = await _events(_chunks(_d({"content": "par"})))
    assert cut[-1][0] == "error"


def test_a_thread_is_refused_in_the_shape_the_sdk_falls_back_on() -> None:
    from kvgate.fronts.messages.errors import error_body

    base: dict[str, Any] = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    assert "thread" not in translate.to_chat({**base, "thread": None}, S)
    for thread in ({"type": "create"}, {"type": "continue", "previous_message_id": "msg_1"}):
        with pytest.raises(BadRequest) as ei:
            translate.to_chat({**base, "thread": thread}, S)
        assert ei.value.status == 400
        assert error_body(400, ei.value)["error"]["details"] == {"error_code": "thread_unsupported_request",
                                                                  "unsupported": ["thread"]}
    with pytest.raises(BadRequest) as other:
        translate.to_chat({**base, "container": "c"}, S)
    assert "details" not in error_body(400, other.value)["error"]  # only the thread refusal carries them
