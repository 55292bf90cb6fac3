"""Chat-template rendering the way Hugging Face transformers (and so vLLM) renders it.

The environment matters for byte parity: a sandboxed Jinja with ``trim_blocks``/``lstrip_blocks``,
``loopcontrols``, and a ``tojson`` that keeps key order and non-ASCII (Jinja's own sorts keys and
escapes HTML, which would change the prompt's bytes).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment


class TemplateError(ValueError):
    """The template refused the conversation (``raise_exception``) or failed to render."""


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise(message: str) -> None:
    raise TemplateError(message)


def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """What vLLM hands the template: text parts joined, tool-call argument strings parsed into objects.

    vLLM flattens text content parts with "\\n" for templates that take string content (it detects the
    template's content format; ours reads strings), and parses assistant
    ``tool_calls[].function.arguments`` from JSON strings into dicts (transformers' convention; empty
    becomes ``{}``), so the template re-serialises them with ``tojson``: the bytes the engine caches are
    the re-serialised arguments, not the client's string. Messages that need neither are passed as
    they are (no copy: long histories are rendered on every request).
    """
    out: list[Mapping[str, Any]] = []
    for m in messages:
        content = m.get("content")
        calls = m.get("tool_calls") if m.get("role") == "assistant" else None
        if not isinstance(content, list) and not calls:
            out.append(m)
            continue
        msg = dict(m)
        if isinstance(content, list):
            msg["content"] = "\n".join(p.get("text", "") for p in content
                                       if isinstance(p, dict) and p.get("type") == "text")
        if calls:
            new_calls = []
            for call in calls:
                fn = call.get("function") if isinstance(call, dict) else None
                if not isinstance(fn, dict):
                    new_calls.append(call)
                    continue
                args = fn.get("arguments")
                if not args:
                    args = {}
                elif isinstance(args, str):
                    try:
                        args = json.loads(args)
                    except json.JSONDecodeError:
                        pass  # left as a string: the template prints it verbatim
                new_calls.append({**call, "function": {**fn, "arguments": args}})
            msg["tool_calls"] = new_calls
        out.append(msg)
    return out


def normalize_tools(tools: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Tools as vLLM's request model dumps them: every declared field present, absent ones null."""
    if not tools:
        return None
    out = []
    for t in tools:
        fn = dict(t.get("function") or {})
        norm_fn: dict[str, Any] = {
            "name": fn.get("name"),
            "description": fn.get("description"),
            "parameters": fn.get("parameters"),
        }
        for k, v in fn.items():
            if k not in norm_fn:
                norm_fn[k] = v
        out.append({"type": t.get("type", "function"), "function": norm_fn})
    return out


class ChatTemplate:
    def __init__(self, source: str, special_tokens: Mapping[str, str | None] | None = None) -> None:
        self.source = source
        self._compiled = compile_template(source)
        self._special = dict(special_tokens or {})

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        kwargs = dict(self._special)
        kwargs.update(template_kwargs or {})
        try:
            return self._compiled.render(
                messages=normalize_messages(messages),
                tools=normalize_tools(tools),
                add_generation_prompt=add_generation_prompt,
                **kwargs,
            )
        except TemplateError:
            raise
        except (jinja2.TemplateError, TypeError, AttributeError, KeyError) as exc:
            raise TemplateError(f"chat template failed: {exc}") from exc
