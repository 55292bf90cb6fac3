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


# What real vLLM (0.32, hermes / deepseek_v3 / kimi_k2 tool parsers, qwen3 / deepseek_r1 reasoning parsers)
# answers, and clients echo, that the simulator's answers never showed (issue 24).

def vllm_call(cid: str, args: str) -> dict[str, Any]:
    return call(cid, args, name="bash")


def test_kimi_style_ids_repeat_across_turns_and_the_meaning_decides() -> None:
    # vLLM's Kimi-K2 ids are functions.<name>:<n>: two turns can carry the same id.
    first = {"role": "assistant", "content": "", "reasoning": "look first",
             "tool_calls": [vllm_call("functions.bash:0", '{"command": "ls -la", "timeout": 5}')]}
    second = {"role": "assistant", "content": "", "reasoning": "then test",
              "tool_calls": [vllm_call("functions.bash:0", '{"command": "pytest -q", "timeout": 30}')]}
    echoed = {**first, "tool_calls": [vllm_call("functions.bash:0", '{"timeout":5,"command":"ls -la"}')]}
    assert find_exact([first, second], echoed) is first
    out = canonicalize([{"role": "user", "content": "go"}, echoed], PROFILES["kimi-k2"], [first, second], words)
    assert out.messages[1]["tool_calls"] == first["tool_calls"] and [r.field for r in out.restored] == [
        "tool_calls.arguments"]


def test_rewritten_ids_are_matched_by_meaning_and_kept() -> None:
    # A client that renumbers tool-call ids (call_0, ...) and re-dumps the arguments: the exact arguments
    # come back, with the client's ids (its tool results name them).
    exact = {"role": "assistant", "content": "", "reasoning": "r",
             "tool_calls": [vllm_call("chatcmpl-tool-9f0a6e0a8ed54f77", '{"command": "cat setup.py", "timeout": 30}')]}
    echoed = {"role": "assistant", "content": None,
              "tool_calls": [vllm_call("call_0", '{"timeout": 30, "command": "cat setup.py"}')]}
    out = canonicalize([{"role": "user", "content": "go"}, echoed], PROFILES["qwen3"], [exact], words)
    tc = out.messages[1]["tool_calls"][0]
    assert tc["id"] == "call_0" and tc["function"]["arguments"] == '{"command": "cat setup.py", "timeout": 30}'
    assert out.messages[1]["reasoning"] == "r"
    assert sorted(r.field for r in out.restored) == ["reasoning_omitted", "tool_calls.arguments"]


def test_a_repeated_call_with_other_reasoning_is_not_guessed() -> None:
    a = {"role": "assistant", "content": "", "reasoning": "one", "tool_calls": [vllm_call("x", '{"q": 1}')]}
    b = {"role": "assistant", "content": "", "reasoning": "two", "tool_calls": [vllm_call("y", '{"q": 1}')]}
    assert find_exact([a, b], {"role": "assistant", "tool_calls": [vllm_call("z", '{"q":1}')]}) is None
    assert find_exact([a, b], {"role": "assistant", "tool_calls": [vllm_call("y", '{"q":1}')]}) is b


def test_blank_content_before_a_tool_call_is_restored() -> None:
    # The hermes parser returns the model's "\n\n" before <tool_call> as content; clients send "" or null.
    exact = {"role": "assistant", "content": "\n\n", "reasoning": "r",
             "tool_calls": [vllm_call("t1", '{"command": "ls -la", "timeout": 5}')]}
    for blank in ("", None):
        echoed = {"role": "assistant", "content": blank, "reasoning": "r",
                  "tool_calls": [vllm_call("t1", '{"timeout": 5, "command": "ls -la"}')]}
        out = canonicalize([{"role": "user", "content": "go"}, echoed], PROFILES["qwen3"], [exact], words)
        assert out.messages[1]["content"] == "\n\n"
        assert [r.field for r in out.restored] == ["tool_calls.arguments", "content"]
    # Content that says something is never taken for blank.
    said = {"role": "assistant", "content": "I will look.", "tool_calls": exact["tool_calls"]}
    assert reserialization(said, exact) is None


def test_a_reply_that_is_all_reasoning_is_found_by_its_reasoning() -> None:
    # max_tokens ended the reply inside its thought: vLLM answers content null, reasoning "...".
    exact = {"role": "assistant", "content": "", "reasoning": "still thinking about"}
    moved = {"role": "assistant", "content": None, "reasoning_content": "still thinking about"}
    out = canonicalize([{"role": "user", "content": "go"}, moved], PROFILES["qwen3"], [exact], words)
    assert out.messages[1]["reasoning"] == "still thinking about"
    assert [r.field for r in out.restored] == ["reasoning_field:reasoning_content"]
    # Empty and without reasoning, it names no reply.
    assert find_exact([exact], {"role": "assistant", "content": None}) is None


def test_copies_of_one_reply_are_one_reply() -> None:
    # Clients without a conversation key that share their first messages share a conversation: its record
    # then holds copies of one reply (same prompt, same seed), which are not ambiguous.
    a = {"role": "assistant", "content": "Found it.", "reasoning": "r"}
    assert find_exact([a, dict(a)], {"role": "assistant", "content": "Found it."}) == a


def test_content_parts_are_the_text_they_carry() -> None:
    echoed = {"role": "assistant", "content": [{"type": "text", "text": "Found it."}]}
    assert find_exact(store(), echoed) is EXACT_2
