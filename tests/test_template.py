import json
from pathlib import Path

import pytest

from kvgate.tokens.template import TemplateError, normalize_messages
from kvgate.tokens.tokenizer import ChatTokenizer

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def test_reasoning_kept_inside_tool_chain_and_dropped_before_last_user(tokenizer: ChatTokenizer) -> None:
    msgs = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning": "R1",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    inside = tokenizer.render_chat(msgs, TOOLS)
    assert "<think>\nR1\n</think>" in inside
    after = tokenizer.render_chat([*msgs, {"role": "assistant", "content": "Sunny."},
                                   {"role": "user", "content": "And tomorrow?"}], TOOLS)
    assert "R1" not in after


def test_tool_arguments_are_reserialised_like_vllm(tokenizer: ChatTokenizer) -> None:
    msgs = [{"role": "user", "content": "q"},
            {"role": "assistant", "content": None,
             "tool_calls": [{"id": "c", "type": "function",
                             "function": {"name": "f", "arguments": '{"b":1,"a":"é"}'}}]}]
    text = tokenizer.render_chat(msgs, add_generation_prompt=False)
    # Parsed then dumped with transformers' tojson: spaces after separators, key order and UTF-8 kept.
    assert '"arguments": {"b": 1, "a": "é"}' in text
    assert normalize_messages(msgs)[1]["tool_calls"][0]["function"]["arguments"] == {"b": 1, "a": "é"}
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == '{"b":1,"a":"é"}'  # input untouched


def test_tools_dumped_with_all_fields(tokenizer: ChatTokenizer) -> None:
    text = tokenizer.render_chat([{"role": "user", "content": "x"}], TOOLS)
    assert json.dumps({"type": "function", "function": {"name": "get_weather", "description": None,
                                                        "parameters": {"type": "object"}}}) in text


def test_encode_roundtrip_and_specials(tokenizer: ChatTokenizer) -> None:
    text = tokenizer.render_chat([{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}])
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert ids[0] == tokenizer.token_to_id("<|im_start|>")
    assert tokenizer.eos_token_id == tokenizer.token_to_id("<|im_end|>")


def test_builder_is_deterministic(tmp_path: Path, model_dir: Path) -> None:
    from kvgate.tokens.tinymodel import build_tokenizer

    build_tokenizer(tmp_path)
    assert (tmp_path / "tokenizer.json").read_bytes() == (model_dir / "tokenizer.json").read_bytes()


def test_template_errors_are_typed(tokenizer: ChatTokenizer) -> None:
    with pytest.raises(TemplateError):
        tokenizer.render_chat([])  # the template indexes messages[0]


def test_the_sandbox_changes_nothing_but_time() -> None:
    """Rendered in a plain Jinja environment (the gateway's default, ``template_sandbox``), every template
    the project carries gives byte for byte what the sandbox gives."""
    from kvgate.tokens.template import ChatTemplate
    from kvgate.tokens.tinymodel import ensure_tiny_model

    sources = [p.read_text() for p in sorted((Path(__file__).parents[1] / "data" / "templates").glob("*.jinja"))]
    tiny = ChatTokenizer(ensure_tiny_model())
    sources.append(tiny.template.source)
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "find ü"},
            {"role": "assistant", "content": "", "reasoning": "think", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "search", "arguments": '{"q": "x"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "found"},
            {"role": "assistant", "content": "done", "reasoning": "ok"}, {"role": "user", "content": "next"}]
    tools = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]
    for src in sources:
        for gen in (True, False):
            for t in (tools, None):
                outs = []
                for sandbox in (True, False):
                    try:
                        outs.append(ChatTemplate(src, {"bos_token": "<s>", "eos_token": "</s>"}, sandbox).render(
                            msgs, tools=t, add_generation_prompt=gen))
                    except TemplateError as exc:  # the same refusal either way
                        outs.append(f"error: {exc}")
                assert outs[0] == outs[1] and outs[0]
