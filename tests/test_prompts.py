"""Prompt tokens and hashes: incremental per conversation, always equal to doing it from scratch."""

from __future__ import annotations

import copy
from typing import Any

from kvgate.gateway.prompts import PromptBuilder, common_prefix
from kvgate.router.hashing import VllmHasher, event_int
from kvgate.tokens.tokenizer import ChatTokenizer

TOOLS = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]


def builder(tok: ChatTokenizer, calls: list[Any] | None = None) -> PromptBuilder:
    async def worker_tokenize(model: str, body: dict[str, Any]) -> list[int] | None:
        if calls is not None:
            calls.append(body)
        return tok.encode_chat(body["messages"], body.get("tools")) if "messages" in body else None

    return PromptBuilder({"m": tok}, {"m": VllmHasher(16, seed="0")}, worker_tokenize, 100)


def expected(tok: ChatTokenizer, msgs: list[dict[str, Any]]) -> tuple[int, tuple[int, ...]]:
    ids = tok.encode_chat(msgs, TOOLS)
    return len(ids), tuple(event_int(h) for h in VllmHasher(16, seed="0").block_hashes(ids))


async def test_incremental_equals_scratch_through_a_conversation(tokenizer: ChatTokenizer) -> None:
    b = builder(tokenizer)
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "sys " * 100}, {"role": "user", "content": "go"}]
    steps = []
    for i in range(4):
        msgs.append({"role": "assistant", "content": "", "reasoning": f"think {i} " * 20,
                     "tool_calls": [{"id": f"c{i}", "type": "function",
                                     "function": {"name": "search", "arguments": '{"q": 1}'}}]})
        msgs.append({"role": "tool", "tool_call_id": f"c{i}", "content": "out " * 50})
        steps.append(copy.deepcopy(msgs))
    steps.append([*copy.deepcopy(msgs), {"role": "assistant", "content": "done"}, {"role": "user", "content": "next"}])
    edited = copy.deepcopy(steps[-1])
    edited[1]["content"] = "go, but differently"  # an edit early in the history
    steps.append(edited)
    for msgs_i in steps:
        p = await b.prepare("m", "chat", {"model": "m", "messages": msgs_i, "tools": TOOLS}, "conv")
        assert (p.length, p.hashes) == expected(tokenizer, msgs_i)
    # Later turns re-tokenized only their new text and re-hashed only new blocks.
    assert b.retokenized_chars < 3 * len(tokenizer.render_chat(steps[-1], TOOLS))


async def test_reused_blocks_grow_with_the_history(tokenizer: ChatTokenizer) -> None:
    b = builder(tokenizer)
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "hello " * 200}]
    first = await b.prepare("m", "chat", {"model": "m", "messages": msgs}, "c")
    msgs += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]
    second = await b.prepare("m", "chat", {"model": "m", "messages": msgs}, "c")
    assert first.reused_blocks == 0 and second.reused_blocks >= first.length // 16 - 1


async def test_worker_tokenization_when_no_local_tokenizer(tokenizer: ChatTokenizer) -> None:
    calls: list[Any] = []
    b = PromptBuilder({}, {"m": VllmHasher(16, seed="0")}, builder(tokenizer, calls)._worker_tokenize, 10)
    msgs = [{"role": "user", "content": "hi " * 40}]
    p = await b.prepare("m", "chat", {"model": "m", "messages": msgs, "tools": TOOLS}, "c")
    assert p.source == "worker" and len(calls) == 1 and p.length == len(tokenizer.encode_chat(msgs, TOOLS))


async def test_token_id_prompts_and_salts(tokenizer: ChatTokenizer) -> None:
    b = builder(tokenizer)
    ids = list(range(100))
    plain = await b.prepare("m", "completions", {"model": "m", "prompt": ids}, "c")
    salted = await b.prepare("m", "completions", {"model": "m", "prompt": ids, "cache_salt": "t"}, "c")
    assert plain.length == 100 and plain.hashes != salted.hashes
    assert salted.hashes == tuple(event_int(h) for h in VllmHasher(16, seed="0").block_hashes(ids, cache_salt="t"))


def testcommon_prefix() -> None:
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2 and common_prefix("abc", "abc") == 3
    assert common_prefix([], [1]) == 0 and common_prefix("x" * 1000 + "a", "x" * 1000 + "b") == 1000
    assert common_prefix([1, 2, 3], (1, 2, 9)) == 2  # a list and a tuple of the same tokens agree


async def test_another_conversations_render_never_leaks_into_hashing(tokenizer: ChatTokenizer) -> None:
    b = builder(tokenizer)
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "system " * 300}, {"role": "user", "content": "q"}]
    await b.prepare("m", "chat", {"model": "m", "messages": msgs, "tools": TOOLS}, "C")
    for _ in range(2):
        b.render_tokens("m", [{"role": "user", "content": "other " * 50}], None, "X#chain")
    edited = [{"role": "system", "content": "changed " * 300}, {"role": "user", "content": "q"}]
    p = await b.prepare("m", "chat", {"model": "m", "messages": edited, "tools": TOOLS}, "C")
    assert p.reused_blocks == 0 and (p.length, p.hashes) == expected(tokenizer, edited)
