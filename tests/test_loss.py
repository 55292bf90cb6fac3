"""Loss explanation: every lost token gets a cause, and the causes add up to the loss."""

from __future__ import annotations

from typing import Any

from kvgate.gateway.loss import explain_cache, explain_prompt

S = {"role": "system", "content": "S"}
U1 = {"role": "user", "content": "q1"}
A1 = {"role": "assistant", "content": "a1", "reasoning": "r1"}
U2 = {"role": "user", "content": "q2"}


def chain(n: int) -> list[int]:
    return list(range(n))


def test_extension_loses_only_the_partial_block() -> None:
    loss = explain_prompt(chain(100), chain(100) + [7] * 50, 16, [S, U1, A1], [S, U1, A1, U2])
    assert (loss.reusable, loss.best, loss.cause) == (100, 96, "block_alignment") and loss.lost == 4


def test_divergence_is_attributed_to_the_first_changed_message() -> None:
    prompt = chain(40) + [999] * 80
    cases: list[tuple[list[dict[str, Any]], str]] = [
        ([S, U1, {**A1, "reasoning": None}, U2], "reasoning_dropped"),
        ([{"role": "system", "content": "S2"}, U1, A1, U2], "system_prompt_changed"),
        ([S, {"role": "user", "content": "edited"}, A1, U2], "client_edit"),
        ([S, U1, A1, U2], "reasoning_dropped"),  # same messages, template rendered them differently
    ]
    for msgs, cause in cases:
        loss = explain_prompt(chain(100), prompt, 16, [S, U1, A1], msgs)
        assert loss.cause == cause, msgs
        assert loss.reusable == 100 and loss.best == 32 and loss.lost == 68


def test_reserialisation_is_named() -> None:
    old = {"role": "assistant", "content": "", "tool_calls": [{"id": "t", "function": {"name": "f",
                                                                                          "arguments": '{"a": 1}'}}]}
    new = {"role": "assistant", "content": "", "tool_calls": [{"id": "t", "function": {"name": "f",
                                                                                          "arguments": '{"a":1}'}}]}
    loss = explain_prompt(chain(64), chain(20) + [5] * 60, 16, [S, U1, old], [S, U1, new])
    assert loss.cause == "reserialization" and "tool_calls.arguments" in loss.detail


def test_policy_drop_is_labelled() -> None:
    loss = explain_prompt(chain(64), chain(20) + [5] * 60, 16, [S, U1, A1], [S, U1, {**A1, "reasoning": None}],
                          policy_changed=[2])
    assert loss.cause == "reasoning_dropped" and "policy" in loss.detail


def test_cache_side_loss_is_rerouted_or_evicted_and_adds_up() -> None:
    assert explain_cache(best=96, cached=96, chosen_matched_tokens=96, best_matched_tokens=96) == (0, None)
    assert explain_cache(96, 32, 32, 96) == (64, "rerouted")
    assert explain_cache(96, 0, 0, 0) == (96, "evicted")
    prompt_loss = explain_prompt(chain(100), chain(50) + [1] * 70, 16, [S, U1, A1], [S, {**U1, "content": "x"}, A1])
    missing, _ = explain_cache(prompt_loss.best, 16, 16, 48)
    assert prompt_loss.lost + missing == prompt_loss.reusable - 16  # everything lost is explained
