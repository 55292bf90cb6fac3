"""The per-turn tokenization path (prompt from the record's chain, then the turn's chain from the prompt)
against a full encode of the rendered text, on random agent conversations."""

from __future__ import annotations

import json
import random
from typing import Any

from kvgate.gateway.prompts import PromptBuilder
from kvgate.router.hashing import HashSpec
from kvgate.tokens.tokenizer import ChatTokenizer

TOOLS = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]
SPEC = HashSpec(16, seed="0")
WORDS = "the tool file Ünïcode ✓ <think> </tool_call> <|im_end|> error fix 42 {\"a\": 1}\n\n".split(" ")


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def reply(rng: random.Random, i: int) -> dict[str, Any]:
    m: dict[str, Any] = {"role": "assistant", "content": words(rng, rng.randrange(0, 30))}
    if rng.random() < 0.6:
        m["reasoning"] = words(rng, rng.randrange(1, 40))
    if rng.random() < 0.6:
        m["tool_calls"] = [{"id": f"c{i}", "type": "function",
                            "function": {"name": "search", "arguments": json.dumps({"q": words(rng, 3)})}}]
    return m


async def test_incremental_turns_equal_a_full_encode(tokenizer: ChatTokenizer) -> None:
    async def no_worker(model: str, body: dict[str, Any]) -> list[int] | None:
        return None

    for seed in range(12):
        rng = random.Random(seed)
        b = PromptBuilder({"m": tokenizer}, lambda m: [SPEC], no_worker)
        msgs: list[dict[str, Any]] = [{"role": "system", "content": words(rng, 50)},
                                      {"role": "user", "content": words(rng, 30)}]
        chain = None
        for i in range(10):
            body = {"model": "m", "messages": msgs, "tools": TOOLS}
            before = b.retokenized_chars
            p = await b.prepare("m", "chat", body, chain)
            rendered = tokenizer.render_chat(msgs, TOOLS)
            assert p.tokens is not None and list(p.tokens) == tokenizer.encode(rendered), (seed, i)
            assert p.source == "local" and p.chain is not None
            if chain is not None and rendered.startswith(chain.text):
                # Only the text past the chain (from its last added token) was encoded again.
                assert b.retokenized_chars - before <= len(rendered) - len(chain.text) + 64, (seed, i)
            r = reply(rng, i)
            before = b.retokenized_chars
            chain = b.chain_for("m", [*msgs, r], TOOLS, p.chain)
            history = tokenizer.render_chat([*msgs, r], TOOLS, add_generation_prompt=False).rstrip("\n")
            assert chain is not None and list(chain.tokens) == tokenizer.encode(history), (seed, i)
            assert chain.text == history
            assert [chain.tokens[t] for t in chain.anchor_tokens] == \
                [tokenizer.token_to_id(history[c:].split(">", 1)[0] + ">") for c in chain.anchor_chars]
            msgs = [*msgs, r]
            if "tool_calls" in r:
                msgs.append({"role": "tool", "tool_call_id": f"c{i}", "content": words(rng, rng.randrange(5, 200))})
            else:
                msgs.append({"role": "user", "content": words(rng, rng.randrange(1, 60))})
            if rng.random() < 0.1:  # an edit early in the history
                msgs[1] = {"role": "user", "content": words(rng, 10)}


def test_an_anchor_not_at_its_added_token_is_refused(tokenizer: ChatTokenizer) -> None:
    text = "a <|im_start|>user\nhi<|im_end|>\n"
    start, end = tokenizer.token_to_id("<|im_start|>"), tokenizer.token_to_id("<|im_end|>")
    assert start is not None and end is not None
    [(ids, at)] = tokenizer.encode_anchored([text], [[(2, start), (text.index("<|im_end|>"), end)]])
    assert ids == tokenizer.encode(text) and at == [ids.index(start), ids.index(end)]
    [(_, moved)] = tokenizer.encode_anchored([text], [[(3, start), (text.index("<|im_end|>"), end)]])
    assert moved == [None, None]
    [(_, missing)] = tokenizer.encode_anchored([text], [[(2, start), (0, start)]])
    assert missing == [ids.index(start), None]
    twice = text + text
    [(ids2, both)] = tokenizer.encode_anchored([twice], [[(2, start), (len(text) + 2, start)]])
    assert both == [ids2.index(start), ids2.index(start, ids2.index(start) + 1)]
