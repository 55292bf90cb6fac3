"""Prompt tokens and hashes: incremental per conversation, always equal to doing it from scratch."""

from __future__ import annotations

import copy
from typing import Any

from kvgate.gateway.prompts import PromptBuilder
from kvgate.router.hashing import HashSpec, VllmHasher, event_int
from kvgate.sequences import common_prefix
from kvgate.tokens.tokenizer import ChatTokenizer

TOOLS = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]
SPEC = HashSpec(16, seed="0")


def builder(tok: ChatTokenizer, calls: list[Any] | None = None) -> PromptBuilder:
    async def worker_tokenize(model: str, body: dict[str, Any]) -> list[int] | None:
        if calls is not None:
            calls.append(body)
        return tok.encode_chat(body["messages"], body.get("tools")) if "messages" in body else None

    return PromptBuilder({"m": tok}, lambda m: [SPEC], worker_tokenize)


def expected(tok: ChatTokenizer, msgs: list[dict[str, Any]]) -> tuple[int, dict[HashSpec, tuple[int, ...]]]:
    ids = tok.encode_chat(msgs, TOOLS)
    return len(ids), {SPEC: tuple(event_int(h) for h in VllmHasher(16, seed="0").block_hashes(ids))}


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
    chain = None
    for msgs_i in steps:
        p = await b.prepare("m", "chat", {"model": "m", "messages": msgs_i, "tools": TOOLS}, chain)
        assert (p.length, p.hashes) == expected(tokenizer, msgs_i)
        chain = p.chain
    # Later turns re-tokenized only their new text and re-hashed only new blocks.
    assert b.retokenized_chars < 3 * len(tokenizer.render_chat(steps[-1], TOOLS))


async def test_reused_blocks_grow_with_the_history(tokenizer: ChatTokenizer) -> None:
    b = builder(tokenizer)
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "hello " * 200}]
    first = await b.prepare("m", "chat", {"model": "m", "messages": msgs}, None)
    msgs += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]
    second = await b.prepare("m", "chat", {"model": "m", "messages": msgs}, first.chain)
    assert first.reused_blocks == 0 and second.reused_blocks >= first.length // 16 - 1


async def test_worker_tokenization_when_no_local_tokenizer(tokenizer: ChatTokenizer) -> None:
    calls: list[Any] = []
    b = PromptBuilder({}, lambda m: [SPEC], builder(tokenizer, calls)._worker_tokenize)
    msgs = [{"role": "user", "content": "hi " * 40}]
    p = await b.prepare("m", "chat", {"model": "m", "messages": msgs, "tools": TOOLS}, None)
    assert p.source == "worker" and len(calls) == 1 and p.length == len(tokenizer.encode_chat(msgs, TOOLS))


async def test_token_id_prompts_and_salts(tokenizer: ChatTokenizer) -> None:
    b = builder(tokenizer)
    ids = list(range(100))
    plain = await b.prepare("m", "completions", {"model": "m", "prompt": ids}, None)
    salted = await b.prepare("m", "completions", {"model": "m", "prompt": ids, "cache_salt": "t"}, None)
    assert plain.length == 100 and plain.hashes != salted.hashes
    want = VllmHasher(16, seed="0").block_hashes(ids, cache_salt="t")
    assert salted.hashes == {SPEC: tuple(event_int(h) for h in want)}


def testcommon_prefix() -> None:
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2 and common_prefix("abc", "abc") == 3
    assert common_prefix([], [1]) == 0 and common_prefix("x" * 1000 + "a", "x" * 1000 + "b") == 1000
    assert common_prefix([1, 2, 3], (1, 2, 9)) == 2  # a list and a tuple of the same tokens agree


async def test_the_completed_turns_chain_hashes_only_its_new_blocks(tokenizer: ChatTokenizer) -> None:
    """The chain of a completed turn keeps the prompt's hashes for the blocks they share, so the next
    prompt of the conversation hashes only what is new, and still equals hashing from scratch."""
    b = builder(tokenizer)
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "system " * 300}, {"role": "user", "content": "q"}]
    first = await b.prepare("m", "chat", {"model": "m", "messages": msgs, "tools": TOOLS}, None)
    reply = {"role": "assistant", "content": "an answer " * 30}
    chain = b.chain_for("m", [*msgs, reply], TOOLS, first.chain)
    nxt = [*msgs, reply, {"role": "user", "content": "and then?"}]
    second = await b.prepare("m", "chat", {"model": "m", "messages": nxt, "tools": TOOLS}, chain)
    assert (second.length, second.hashes) == expected(tokenizer, nxt)
    assert second.reused_blocks >= first.length // 16 - 1
    edited = [{"role": "system", "content": "changed " * 300}, *nxt[1:]]
    third = await b.prepare("m", "chat", {"model": "m", "messages": edited, "tools": TOOLS}, chain)
    assert third.reused_blocks == 0 and (third.length, third.hashes) == expected(tokenizer, edited)


async def test_a_long_prompt_without_a_chain_is_tokenized_only_as_far_as_some_worker_holds_it(
        tokenizer: ChatTokenizer) -> None:
    b = builder(tokenizer)
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "system " * 300}]
    for i in range(60):
        msgs += [{"role": "user", "content": f"question {i} " * 60},
                 {"role": "assistant", "content": f"answer {i} " * 60}]
    full_len, full_hashes = expected(tokenizer, msgs)
    held_blocks = set(full_hashes[SPEC][:20])  # a worker holds the first 20 blocks only

    cold = await b.prepare("m", "chat", {"model": "m", "messages": msgs, "tools": TOOLS}, None,
                           held=lambda spec, block: block in held_blocks)
    assert not cold.complete and cold.tokens is not None and len(cold.tokens) < full_len // 2
    got = cold.hashes[SPEC]
    assert got == full_hashes[SPEC][: len(got)] and len(got) > 20  # exact as far as it went, past the held part
    assert abs(cold.length - full_len) < full_len * 0.1  # the rest is estimated
    # Held all the way: tokenized whole, and equal to doing it from scratch.
    everything = set(full_hashes[SPEC])
    whole = await b.prepare("m", "chat", {"model": "m", "messages": msgs, "tools": TOOLS}, None,
                            held=lambda spec, block: block in everything)
    assert whole.complete and (whole.length, whole.hashes) == (full_len, full_hashes)
    # The turn's chain built from the partial prompt is the whole rendered history.
    reply = {"role": "assistant", "content": "done"}
    chain = b.chain_for("m", [*msgs, reply], TOOLS, cold.chain)
    assert chain is not None
    assert list(chain.tokens) == tokenizer.encode(tokenizer.render_chat([*msgs, reply], TOOLS, False).rstrip("\n"))


async def test_a_long_new_text_is_routed_on_its_head_and_completed_after(tokenizer: ChatTokenizer) -> None:
    """A known conversation's turn that appends a long tool output: tokenized only up to the first block
    past the conversation's chain before routing, and to the same tokens and hashes as from scratch after."""
    b = builder(tokenizer)
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "system " * 100},
                                  {"role": "user", "content": "look around"}]
    first = await b.prepare("m", "chat", {"model": "m", "messages": msgs, "tools": TOOLS}, None)
    reply = {"role": "assistant", "content": "I will look."}
    chain = b.chain_for("m", [*msgs, reply], TOOLS, first.chain)
    assert chain is not None
    nxt = [*msgs, reply, {"role": "user", "content": "tool output: " + "line of text 42\n" * 800}]
    body = {"model": "m", "messages": nxt, "tools": TOOLS}
    full_len, full_hashes = expected(tokenizer, nxt)
    nothing: set[int] = set()

    head = await b.prepare("m", "chat", body, chain, held=lambda spec, block: block in nothing, defer=True)
    assert not head.complete and head.text is not None and head.tokens is not None
    assert len(chain.tokens) < len(head.tokens) < len(chain.tokens) + 200  # the chain and one block, not 8,000
    assert head.hashes[SPEC] == full_hashes[SPEC][: len(head.hashes[SPEC])]
    assert list(head.tokens) == tokenizer.encode_chat(nxt, TOOLS)[: len(head.tokens)]
    assert abs(head.length - full_len) < full_len * 0.5  # the rest estimated (load only)
    whole = b.complete("m", head, None)
    assert whole.complete and whole.text is None and (whole.length, whole.hashes) == (full_len, full_hashes)

    # A worker holds the head's last block (the same turn, still in flight there): tokenized whole now.
    held = set(full_hashes[SPEC])
    now = await b.prepare("m", "chat", body, chain, held=lambda spec, block: block in held, defer=True)
    assert now.complete and now.text is None and (now.length, now.hashes) == (full_len, full_hashes)
    # The rest might exceed a context limit (counted in bytes, a token's least): checked on exact tokens,
    # so tokenized whole now; under it, deferred.
    rest_bytes = len(head.text or "") and len(head.text) - len(head.chain.text if head.chain else "")
    limited = await b.prepare("m", "chat", body, chain, held=lambda spec, block: block in nothing, defer=True,
                              token_limit=len(head.tokens) + rest_bytes)
    assert limited.complete and limited.length == full_len
    roomy = await b.prepare("m", "chat", body, chain, held=lambda spec, block: block in nothing, defer=True,
                            token_limit=len(head.tokens) + rest_bytes + 1)
    assert not roomy.complete
    # A short new text: tokenized at once (cheaper than a second pass).
    short = [*msgs, reply, {"role": "user", "content": "ok"}]
    quick = await b.prepare("m", "chat", {"model": "m", "messages": short, "tools": TOOLS}, chain,
                            held=lambda spec, block: block in nothing, defer=True)
    assert quick.complete and (quick.length, quick.hashes) == expected(tokenizer, short)


def test_anchors_from_the_added_tokens_strings_equal_those_from_every_tokens_offset(tokenizer: ChatTokenizer) -> None:
    from kvgate.gateway.chaintok import ChainTokenizer

    fast, slow = ChainTokenizer(tokenizer), ChainTokenizer(tokenizer)
    slow._anchored = False
    assert fast._anchored  # the tiny model's added tokens are plain
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "sys <think> not a tag" * 3},
                                  {"role": "user", "content": "Ünïcode ✓ " * 40 + "<|im_end|> inside text"},
                                  {"role": "assistant", "content": "", "reasoning": "hm",
                                   "tool_calls": [{"id": "c", "type": "function",
                                                   "function": {"name": "search", "arguments": '{"q": 1}'}}]},
                                  {"role": "tool", "tool_call_id": "c", "content": "out " * 300}]
    text = tokenizer.render_chat(msgs, TOOLS)
    for release in (False, True):
        a, b = fast._whole(fast._base(None, text)[0], text, 0, release), slow._whole(slow._base(None, text)[0], text, 0)
        assert (list(a.tokens), list(a.anchor_chars), list(a.anchor_tokens)) == \
            (list(b.tokens), list(b.anchor_chars), list(b.anchor_tokens))
        assert list(a.tokens) == tokenizer.encode(text) and len(a.anchor_chars) > 8
