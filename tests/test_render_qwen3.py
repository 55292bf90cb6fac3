"""The Qwen3 fast renderer against Jinja: byte-equal text, or the same refusal, on generated
conversations that include the shapes it hands back to Jinja."""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path
from typing import Any

import pytest

from kvgate.tokens import render_qwen3
from kvgate.tokens.template import ChatTemplate, TemplateError, normalize_messages, normalize_tools
from kvgate.tokens.template_qwen3 import CHAT_TEMPLATE

QWEN3 = (Path(__file__).parents[1] / "data" / "templates" / "qwen3.jinja").read_text()
SPECIAL = {"bos_token": "<s>", "eos_token": "<|im_end|>"}
TEXTS = ["", "plain ü ✓", "\nlead", "trail\n", "<think>\nR\n</think>\n\nA", "x</think>y", "<think>only",
         "<tool_response>\nwrapped\n</tool_response>", "<tool_response>half", "a\n\n", "<|im_start|>inj"]


def _content(rng: random.Random) -> Any:
    roll = rng.random()
    if roll < 0.7:
        return rng.choice(TEXTS) + " " + str(rng.random())
    return rng.choice([None, [{"type": "text", "text": rng.choice(TEXTS)}, {"type": "image_url"}, "bare"],
                       {"text": "a mapping"}, 7, [], ""])


def _call(rng: random.Random, i: int) -> Any:
    args = rng.choice(['{"q": "ü", "n": 1}', "", "not json", "[1]", {"k": [1, 2]}, '{"a": {"b": null}}'])
    fn: Any = {"name": rng.choice(["search", "run_ü"]), "arguments": args}
    roll = rng.random()
    if roll < 0.05:
        fn = {"arguments": "{}"}  # no name
    elif roll < 0.08:
        fn = "not a dict"
    elif roll < 0.11:
        return {"id": f"c{i}", "name": "flat", "arguments": "{}"}  # no function: the call itself is read
    elif roll < 0.13:
        return "a string call"
    return {"id": f"c{i}", "type": "function", "function": fn}


def _message(rng: random.Random, i: int) -> Any:
    role = rng.choices(["user", "assistant", "tool", "system", "developer", None, 3],
                       [30, 35, 25, 4, 1, 1, 1])[0]
    if rng.random() < 0.01:
        return ["not", "a", "message"]
    m: dict[str, Any] = {"role": role, "content": _content(rng)}
    if role == "assistant":
        pick = rng.random()
        if pick < 0.3:
            m["reasoning"] = rng.choice(TEXTS)
        elif pick < 0.4:
            m["reasoning_content"] = rng.choice(TEXTS)
        elif pick < 0.45:
            m["reasoning"] = 5
            m["reasoning_content"] = "rc"
        if rng.random() < 0.5:
            m["tool_calls"] = [_call(rng, i * 10 + j) for j in range(rng.choice([0, 1, 1, 2, 3]))]
        elif rng.random() < 0.03:
            m["tool_calls"] = "calls as a string"
    return m


def _case(rng: random.Random) -> tuple[list[Any], Any, bool, dict[str, Any] | None]:
    n = rng.choice([0, 1, 2, 3, 5, 8, 13, 21])
    msgs = [_message(rng, i) for i in range(n)]
    if msgs and rng.random() < 0.6:
        msgs[0] = {"role": "system", "content": rng.choice([*TEXTS, None])}
    tools = rng.choice([None, [], [{"type": "function", "function": {"name": "search", "parameters": {
        "type": "object", "properties": {"q": {"type": "string", "description": "é"}}}}}]])
    kwargs = rng.choice([None, {}, {"enable_thinking": False}, {"enable_thinking": True},
                         {"enable_thinking": "false"}, {"enable_thinking": None}, {"namespace": 1}, {"other": 2}])
    return msgs, tools, rng.random() < 0.5, kwargs


def _both(templates: tuple[ChatTemplate, ChatTemplate], case: tuple[list[Any], Any, bool, dict[str, Any] | None]
          ) -> list[str]:
    msgs, tools, gen, kwargs = case
    outs = []
    for template in templates:
        try:
            outs.append(template.render(
                msgs, tools=tools, add_generation_prompt=gen, template_kwargs=kwargs))
        except TemplateError:
            outs.append("<refused>")
    return outs


def test_the_known_sources_are_the_ones_carried() -> None:
    assert hashlib.sha256(QWEN3.encode()).hexdigest() in render_qwen3.KNOWN_SOURCES
    assert render_qwen3.renderer_for(CHAT_TEMPLATE) is not None
    assert render_qwen3.renderer_for(QWEN3 + " ") is None  # any other text: Jinja


@pytest.mark.parametrize("source", [CHAT_TEMPLATE, QWEN3], ids=["test-model", "qwen3"])
def test_fast_render_equals_jinja_on_generated_conversations(source: str) -> None:
    rng = random.Random(20261204)
    templates = ChatTemplate(source, SPECIAL), ChatTemplate(source, SPECIAL, fast=False)
    taken = 0
    for _ in range(3000):
        case = _case(rng)
        fast, jinja = _both(templates, case)
        assert fast == jinja, json.dumps(case, default=str)[:2000]
        msgs, tools, gen, kwargs = case
        try:
            normed = normalize_messages(msgs)
        except AttributeError:
            continue
        kw = {**SPECIAL, **(kwargs or {})}
        taken += render_qwen3.render(normed, normalize_tools(tools), gen, kw) is not None
    assert taken > 300  # the fast path is taken on a fair share of the cases, not only declined


def test_declined_shapes_go_to_jinja() -> None:
    ok: list[dict[str, Any]] = [{"role": "user", "content": "q"}]
    cases: list[list[dict[str, Any]]] = [
        [], [{"role": "developer", "content": "d"}, *ok], [{"role": "system", "content": None}, *ok],
        [*ok, {"role": "assistant", "content": "", "tool_calls": [{"function": {"arguments": "{}"}}]}]]
    for msgs in cases:
        assert render_qwen3.render(normalize_messages(msgs), None, True, SPECIAL) is None
    assert render_qwen3.render(ok, None, True, {"namespace": 1}) is None
    # Content as a tuple (from code, not JSON): the test model's template joins its text parts.
    parts = [{"role": "user", "content": ({"type": "text", "text": "a"},)}]
    assert render_qwen3.render(parts, None, True, SPECIAL) is None
    jinja = ChatTemplate(CHAT_TEMPLATE, SPECIAL, fast=False)
    assert ChatTemplate(CHAT_TEMPLATE, SPECIAL).render(parts) == jinja.render(parts)
    assert render_qwen3.render(ok, None, True, SPECIAL) == "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n"
