"""Canonical history per model protocol: restoration of re-serialisations, turn-boundary policies."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvgate.history.canonical import canonicalize, find_exact, open_turn_start, reserialization
from kvgate.history.protocols import PROFILES, ReasoningPolicy, get_protocol


def words(text: str, n: int) -> str:
    return " ".join(text.split()[:n])


def call(cid: str, args: str, name: str = "search") -> dict[str, Any]:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}


EXACT_1 = {"role": "assistant", "content": "", "reasoning": "I need to search first.",
           "tool_calls": [call("t1", '{"q": "kv cache", "k": 3}')]}
EXACT_2 = {"role": "assistant", "content": "Found it.", "reasoning": "The tool answered."}


def conversation(first: dict[str, Any], second: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "system", "content": "S"}, {"role": "user", "content": "find it"}, first,
            {"role": "tool", "tool_call_id": "t1", "content": "result"}, second, {"role": "user", "content": "next"}]


def store() -> list[dict[str, Any]]:
    return [EXACT_1, EXACT_2]


def test_open_turn_is_after_the_last_real_user_message() -> None:
    msgs = conversation(EXACT_1, EXACT_2)
    assert open_turn_start(msgs) == 5
    assert open_turn_start(msgs[:4]) == 1  # inside the tool chain of the first turn


@pytest.mark.parametrize(("client", "fields"), [
    ({**EXACT_1, "tool_calls": [call("t1", '{"k":3,"q":"kv cache"}')]}, ["tool_calls.arguments"]),
    ({k: v for k, v in EXACT_1.items() if k != "reasoning"}, ["reasoning_omitted"]),
    ({**{k: v for k, v in EXACT_1.items() if k != "reasoning"}, "reasoning_content": EXACT_1["reasoning"]},
     ["reasoning_field:reasoning_content"]),
])
def test_reserialisations_are_restored_byte_for_byte(client: dict[str, Any], fields: list[str]) -> None:
    msgs = conversation(client, EXACT_2)
    out = canonicalize(msgs, PROFILES["generic-vllm"], store(), words)
    assert [r.field for r in out.restored] == fields
    assert out.messages[2]["tool_calls"][0]["function"]["arguments"] == '{"q": "kv cache", "k": 3}'
    assert out.messages[2]["reasoning"] == EXACT_1["reasoning"] and "reasoning_content" not in out.messages[2]


@pytest.mark.parametrize("edit", [
    {"content": "I will search."},                                     # content changed
    {"tool_calls": [call("t1", '{"q": "something else", "k": 3}')]},  # arguments changed in meaning
    {"reasoning": "A different thought."},                            # reasoning edited
])
def test_real_edits_are_never_restored(edit: dict[str, Any]) -> None:
    client = {**EXACT_1, **edit}
    out = canonicalize(conversation(client, EXACT_2), PROFILES["generic-vllm"], store(), words)
    assert out.restored == [] and out.messages[2]["content"] == client["content"]
    assert reserialization(client, EXACT_1) is None


def test_drop_policy_removes_completed_turns_reasoning_only() -> None:
    p = PROFILES["generic-vllm"].with_policy(ReasoningPolicy.parse("drop"))
    msgs = conversation(EXACT_1, EXACT_2)
    out = canonicalize(msgs, p, store(), words)
    assert "reasoning" not in out.messages[2] and "reasoning" not in out.messages[4]
    assert out.reasoning_changed == [2, 4]
    # Inside an open turn nothing is removed.
    inside = canonicalize(msgs[:4], p, store(), words)
    assert inside.messages[2]["reasoning"] == EXACT_1["reasoning"] and inside.reasoning_changed == []


def test_deepseek_keeps_reasoning_of_turns_that_used_tools() -> None:
    p = get_protocol("deepseek-v3").with_policy(ReasoningPolicy.parse("drop"))
    out = canonicalize(conversation(EXACT_1, EXACT_2), p, store(), words)
    assert out.messages[2]["reasoning_content"] == EXACT_1["reasoning"]  # tool call: required back
    assert "reasoning_content" not in out.messages[4] and "reasoning" not in out.messages[4]


def test_truncate_policy_and_parsing() -> None:
    p = PROFILES["qwen3"].with_policy(ReasoningPolicy.parse("truncate:2"))
    out = canonicalize(conversation(EXACT_1, EXACT_2), p, store(), words)
    assert out.messages[4]["reasoning"] == "The tool"
    assert str(ReasoningPolicy.parse("TRUNCATE:5")) == "truncate:5"
    for bad in ("truncate:0", "truncate:x", "summarise"):
        with pytest.raises(ValueError):
            ReasoningPolicy.parse(bad)


def test_canonical_form_is_stable_across_turns() -> None:
    p = PROFILES["qwen3"].with_policy(ReasoningPolicy.parse("drop"))
    first = canonicalize(conversation(EXACT_1, EXACT_2), p, store(), words).messages
    later = canonicalize([*conversation(EXACT_1, EXACT_2), {"role": "assistant", "content": "ok"},
                          {"role": "user", "content": "more"}], p, store(), words).messages
    assert json.dumps(later[: len(first) - 1]) == json.dumps(first[:-1])


def test_every_profile_is_shipped() -> None:
    assert {"generic-vllm", "qwen3", "deepseek-v3", "deepseek-r1", "gpt-oss", "kimi-k2", "kvgate-tiny"} <= set(PROFILES)
    assert PROFILES["deepseek-r1"].reasoning_in == "reasoning_content" and PROFILES["qwen3"].reasoning_in == "reasoning"


def test_identical_replies_are_not_guessed() -> None:
    twice = [{"role": "assistant", "content": "Done.", "reasoning": "first"},
             {"role": "assistant", "content": "Done.", "reasoning": "second"}]
    assert find_exact(twice, {"role": "assistant", "content": "Done."}) is None
    once = [{"role": "assistant", "content": "Unique.", "reasoning": "r"}]
    assert find_exact(once, {"role": "assistant", "content": "Unique."}) is not None


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_every_profile_on_a_crafted_conversation(name: str) -> None:
    """Per profile: the open turn is untouched, reasoning goes to the field the engine reads, drop
    removes completed turns' reasoning except where the protocol requires it back (DeepSeek + tools)."""
    p = PROFILES[name].with_policy(ReasoningPolicy.parse("drop"))
    parallel = {**EXACT_1, "tool_calls": [call("t1", '{"q": 1}'), call("t2", '{"q": 2}')]}
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "go"}, parallel,
            {"role": "tool", "tool_call_id": "t1", "content": "a"},
            {"role": "tool", "tool_call_id": "t2", "content": "b"},
            {"role": "assistant", "content": "done", "reasoning_content": "because"},
            {"role": "user", "content": "next"},
            {"role": "assistant", "content": "", "reasoning": "open-turn thought",
             "tool_calls": [call("t3", '{"q": 3}')]},
            {"role": "tool", "tool_call_id": "t3", "content": "c"}]
    out = canonicalize(msgs, p, [], words)
    field, other = p.reasoning_in, ({"reasoning", "reasoning_content"} - {p.reasoning_in}).pop()
    assert out.messages[7][field] == "open-turn thought" and other not in out.messages[7]  # open turn: kept
    assert field not in out.messages[5] and other not in out.messages[5]                    # plain turn: dropped
    kept_with_tools = p.reasoning_required_with_tools
    assert (field in out.messages[2]) == kept_with_tools
    assert [c["function"]["arguments"] for c in out.messages[2]["tool_calls"]] == ['{"q": 1}', '{"q": 2}']
    keep = canonicalize(msgs, PROFILES[name], [], words)
    assert keep.messages[5][field] == "because" and keep.reasoning_changed == []
