"""Loss explanation: every lost token gets a cause, and the causes add up to the loss."""

from __future__ import annotations

from typing import Any

from kvgate.history.loss import explain_cache, explain_prompt

S = {"role": "system", "content": "S"}
U1 = {"role": "user", "content": "q1"}
A1 = {"role": "assistant", "content": "a1", "reasoning": "r1"}
U2 = {"role": "user", "content": "q2"}


def chain(n: int) -> list[int]:
    return list(range(n))


def test_extension_loses_only_the_partial_block() -> None:
    loss = explain_prompt(chain(100), chain(100) + [7] * 50, 16, [S, U1, A1], [S, U1, A1, U2])
    assert (loss.reusable, loss.best, loss.cause) == (100, 96, "block_alignment") and loss.lost == 4


def test_a_reply_ending_on_a_block_boundary_loses_its_last_block_to_alignment_not_the_cache() -> None:
    """The engine holds KV for all but the last token it generated: a 96-token chain is cached as 80."""
    loss = explain_prompt(chain(96), chain(96) + [7] * 50, 16, [S, U1, A1], [S, U1, A1, U2], computed=95)
    assert (loss.reusable, loss.best, loss.cause) == (95, 80, "block_alignment")
    # What the worker then reports cached (80) is all of the best: nothing is left for "evicted".
    assert explain_cache(loss.best, 80, 80, 80) == (0, None)
    unbounded = explain_prompt(chain(96), chain(96) + [7] * 50, 16, [S, U1, A1], [S, U1, A1, U2])
    assert unbounded.best == 96 and explain_cache(unbounded.best, 80, 80, 80) == (16, "evicted")


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


# -- attribution where the tokens diverge (real tokenizer and template) ---------------------------------
from kvgate.history.loss import message_at  # noqa: E402
from kvgate.tokens.spans import anchored_token_starts  # noqa: E402
from kvgate.tokens.tinymodel import ensure_tiny_model  # noqa: E402
from kvgate.tokens.tokenizer import ChatTokenizer  # noqa: E402

TOOLS = [{"type": "function", "function": {"name": "bash", "description": "run",
                                           "parameters": {"type": "object"}}}]
CALL = {"role": "assistant", "content": "", "reasoning": "look at the files first",
        "tool_calls": [{"id": "c1", "type": "function",
                        "function": {"name": "bash", "arguments": '{"command": "ls -la", "timeout": 5}'}}]}


def _render(tok: ChatTokenizer, msgs: list[dict[str, Any]], gen: bool) -> tuple[list[int], list[int]]:
    text = tok.render_chat(msgs, TOOLS, add_generation_prompt=gen)
    if not gen:
        text = text.rstrip("\n")
    # The token->message map as the gateway makes it: from the added-token anchors of the rendered prompt.
    ids, starts = tok.encode_with_starts(text)
    added = {i for t in tok.special_tokens if (i := tok.token_to_id(t)) is not None}
    at = [j for j, t in enumerate(ids) if t in added]
    return ids, anchored_token_starts(text, [starts[j] for j in at], at, msgs)


def test_reasoning_drop_is_named_where_the_tokens_diverge() -> None:
    # The exact client: nothing changed in the messages, but the next user turn closes the tool chain
    # and the Qwen3-style template stops rendering the call's reasoning — at message 2, not at the
    # first message whose content differs (there is none before the new user message 6).
    tok = ChatTokenizer(ensure_tiny_model())
    history = [S, U1, CALL, {"role": "tool", "tool_call_id": "c1", "content": "a.py b.py"},
               {"role": "assistant", "content": "two files", "reasoning": "done"}]
    chain, _ = _render(tok, history, gen=False)
    msgs = [*history, {"role": "user", "content": "now run the tests"}]
    prompt, starts = _render(tok, msgs, gen=True)
    loss = explain_prompt(chain, prompt, 16, history, msgs, starts=starts)
    assert loss.cause == "reasoning_dropped" and loss.detail == "message 2 (template)", loss
    assert loss.diverged_at is not None and message_at(starts, loss.diverged_at) == 2


def test_a_change_that_alters_no_token_is_no_loss() -> None:
    # Re-spaced arguments: vLLM parses and re-dumps them, so the tokens are the same; the loss that is
    # left (the client edited message 1 later on) is named there, not at the re-spaced call.
    tok = ChatTokenizer(ensure_tiny_model())
    history = [S, U1, CALL, {"role": "tool", "tool_call_id": "c1", "content": "a.py"}]
    chain, _ = _render(tok, history, gen=False)
    respaced = {**CALL, "tool_calls": [{**CALL["tool_calls"][0], "function": {
        "name": "bash", "arguments": '{"command":"ls -la","timeout":5}'}}]}
    same_tokens = [*history[:2], respaced, history[3]]
    prompt, starts = _render(tok, same_tokens, gen=True)
    loss = explain_prompt(chain, prompt, 16, history, same_tokens, starts=starts)
    assert loss.lost < 16 and loss.cause in (None, "block_alignment"), loss
    edited = [*history[:3], {**history[3], "content": "a.py c.py"}]
    prompt, starts = _render(tok, [*edited[:2], respaced, edited[3]], gen=True)
    loss = explain_prompt(chain, prompt, 16, history, [*edited[:2], respaced, edited[3]], starts=starts)
    assert loss.cause == "client_edit" and loss.detail == "message 3", loss


def test_retokenized_output_is_its_own_cause() -> None:
    # The engine generated "<tool_call>" as plain-text tokens; the template renders the added token.
    tok = ChatTokenizer(ensure_tiny_model())
    history = [S, U1, CALL]
    rendered, _ = _render(tok, history, gen=False)
    head, _ = _render(tok, [S, U1], gen=True)
    before, after = tok.decode(rendered[len(head):]).split("<tool_call>", 1)
    generated = head + tok.encode(before) + tok.encode("<") + tok.encode("tool_call>") + tok.encode(after)
    assert tok.decode(generated) == tok.decode(rendered) and generated != rendered
    msgs = [*history, {"role": "tool", "tool_call_id": "c1", "content": "a.py"}]
    prompt, starts = _render(tok, msgs, gen=True)
    loss = explain_prompt(generated, prompt, 16, history, msgs, starts=starts, rendered_chain=rendered)
    assert loss.cause == "retokenization" and loss.detail.startswith("message 2"), loss
