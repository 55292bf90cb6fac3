"""``Conversation.within`` sized incrementally (``BodySizes``) against the full walk it replaced."""

from __future__ import annotations

import copy
import json
import random
from array import array
from dataclasses import replace
from typing import Any

from kvgate.router.types import ConversationId
from kvgate.session.conversation import Chain, Conversation, Limits, Message


def walk_value(v: Any) -> int:
    if isinstance(v, str):
        return len(v) + 8
    if isinstance(v, dict):
        return sum(len(k) + walk_value(x) for k, x in v.items()) + 16
    if isinstance(v, list | tuple):
        return sum(walk_value(x) for x in v) + 16
    return 16


def walk_body(c: Conversation) -> int:
    """The full walk ``body_bytes`` did before it was incremental: the reference."""
    chain = c.chain.nbytes if c.chain is not None else 0
    tools = walk_value(c.tools) if c.tools else 0
    return chain + sum(map(walk_value, c.history)) + sum(map(walk_value, c.exact)) + tools


def walk_within(c: Conversation, limits: Limits) -> Conversation:
    """``within`` as it was, on the full walk."""
    conv = c
    if walk_body(conv) > limits.max_bytes and conv.chain is not None:
        conv = replace(conv, chain=None)
    while walk_body(conv) > limits.max_bytes and conv.exact:
        conv = replace(conv, exact=conv.exact[1:])
    if walk_body(conv) > limits.max_bytes:
        conv = replace(conv, history=(), tools=None, responses=())
    return conv


def message(rng: random.Random, i: int) -> Message:
    role = rng.choice(["user", "assistant", "tool"])
    m: Message = {"role": role, "content": "x" * rng.randrange(0, 3_000)}
    if role == "assistant" and rng.random() < 0.5:
        m["reasoning_content"] = "r" * rng.randrange(200)
        m["tool_calls"] = [{"id": f"c{i}", "type": "function",
                            "function": {"name": "run", "arguments": json.dumps({"n": i})}}]
    if role == "tool":
        m["tool_call_id"] = f"c{i}"
    return m


def test_within_and_body_bytes_equal_the_full_walk_after_random_turns() -> None:
    for seed in range(40):
        rng = random.Random(seed)
        limits = Limits(max_exact=rng.choice([3, 8, 256]), max_bytes=rng.choice([6_000, 20_000, 60_000, 1 << 22]))
        conv = Conversation(ConversationId("c"))
        tools: Any = [{"type": "function", "function": {"name": "run", "parameters": {"type": "object"}}}]
        trimmed = 0
        for i in range(30):
            # What the gateway sends: the record's own history objects, then the turn's new messages
            # (sometimes an edited history: a message equal in content but a new object, or one changed).
            history = list(conv.history)
            if history and rng.random() < 0.15:
                j = rng.randrange(len(history))
                history[j] = copy.deepcopy(history[j]) if rng.random() < 0.5 else message(rng, i)
            if rng.random() < 0.05:
                history = []
            history.extend(message(rng, i) for _ in range(rng.randrange(1, 4)))
            reply = message(rng, i)
            if rng.random() < 0.2:
                tools = copy.deepcopy(tools) if rng.random() < 0.7 else [*tools, {"type": "function", "function": {
                    "name": f"t{i}", "description": "d" * rng.randrange(500)}}]
            chain = Chain("t" * rng.randrange(20_000), array("I", range(rng.randrange(3_000))), array("I"),
                          array("I")) if rng.random() < 0.8 else None
            response = f"r{i}" if rng.random() < 0.5 else None
            unbounded = conv.with_reply("m", tuple(history), reply, tools, chain, response,
                                         replace(limits, max_bytes=1 << 40))
            want = walk_within(unbounded, limits)
            got = conv.with_reply("m", tuple(history), reply, tools, chain, response, limits)
            assert got == want, (seed, i)
            assert got.body_bytes() == walk_body(got), (seed, i)
            trimmed += got != unbounded
            conv = got
        assert limits.max_bytes == 1 << 22 or trimmed, seed  # the bound was exercised


def test_a_record_changed_behind_its_sizes_is_measured_afresh() -> None:
    """A ``replace`` of the history or the exact replies elsewhere leaves ``sizes`` of the old parts: they
    must not be taken for the new ones."""
    conv = Conversation(ConversationId("c")).with_reply(
        "m", ({"role": "user", "content": "u" * 100},), {"role": "assistant", "content": "a"}, None, None, None,
        Limits())
    assert conv.sizes is not None
    grown = replace(conv, history=(*conv.history, {"role": "user", "content": "v" * 5_000}),
                    exact=({"role": "assistant", "content": "b" * 700},))
    assert grown.body_bytes() == walk_body(grown) > conv.body_bytes()
    tight = Limits(max_bytes=walk_body(grown) - 1)
    assert grown.within(tight) == walk_within(grown, tight)


def test_trimming_stops_on_the_bound_itself() -> None:
    """A record exactly at the bound once the oldest reply is gone keeps every other reply."""
    chain = Chain("t" * 5_000, array("I", range(100)), array("I"), array("I"))
    conv = Conversation(ConversationId("c"))
    for i in range(3):
        reply = {"role": "assistant", "content": "a" * 300}
        conv = conv.with_reply("m", ({"role": "user", "content": f"u{i}"},), reply, None, chain, None, Limits())
    at = walk_body(replace(conv, chain=None, exact=conv.exact[1:]))
    got = conv.within(Limits(max_bytes=at))
    assert got == walk_within(conv, Limits(max_bytes=at)) and len(got.exact) == 2
