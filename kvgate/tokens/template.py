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

from kvgate import safejson
from kvgate.tokens.render_qwen3 import renderer_for


class TemplateError(ValueError):
    """The template refused the conversation (``raise_exception``) or failed to render."""


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise(message: str) -> None:
    raise TemplateError(message)


_DICT_ATTRS = frozenset(dir(dict))


class _Sandbox(ImmutableSandboxedEnvironment):
    """The sandbox transformers and vLLM render chat templates in, with one fast path: ``message.role``
    on a plain dict whose key is not a dict attribute. Jinja resolves such a name to the item anyway (after
    failing to find the attribute), and an item of the request's data needs none of the sandbox's
    attribute checks; on a long history those checks were most of the render time."""

    def getattr(self, obj: Any, attribute: str) -> Any:
        if type(obj) is dict and attribute not in _DICT_ATTRS and attribute in obj:
            return obj[attribute]
        return super().getattr(obj, attribute)


def compile_template(source: str, sandbox: bool = True) -> jinja2.Template:
    """``sandbox`` False renders in a plain Jinja environment: the same output in half the time (the
    sandbox guards against the template's own code, not against the data it renders), for templates as
    trusted as the deployment itself."""
    opts: dict[str, Any] = {"trim_blocks": True, "lstrip_blocks": True, "extensions": [jinja2.ext.loopcontrols]}
    env = _Sandbox(**opts) if sandbox else jinja2.Environment(**opts)
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """What vLLM (0.32) hands the template.

    - Text content parts are joined with "\\n" (vLLM detects the template's content format; the
      templates kvgate serves read strings).
    - An assistant's reasoning, sent as ``reasoning`` or ``reasoning_content``, is passed under both
      names (templates read one or the other: Qwen3, DeepSeek and Kimi read ``reasoning_content``).
    - ``tool_calls[].function.arguments`` JSON strings are parsed into objects (transformers'
      convention); empty, malformed or non-object arguments become ``{}``, and an empty ``tool_calls``
      list is dropped. The template re-serialises the objects (``tojson``): the bytes the engine caches
      are the re-serialised arguments, not the client's string.

    Messages that need none of this are passed as they are (no copy: long histories are rendered on
    every request).
    """
    out: list[Mapping[str, Any]] = []
    for m in messages:
        content = m.get("content")
        assistant = m.get("role") == "assistant"
        calls = m.get("tool_calls") if assistant else None
        reasoning = _reasoning(m) if assistant else None
        if not isinstance(content, list) and calls is None and reasoning is None:
            out.append(m)
            continue
        msg = dict(m)
        if isinstance(content, list):
            msg["content"] = "\n".join(p.get("text", "") for p in content
                                       if isinstance(p, dict) and p.get("type") == "text")
        if reasoning is not None:
            msg["reasoning"] = msg["reasoning_content"] = reasoning
        if isinstance(calls, list) and not calls:
            del msg["tool_calls"]
        elif isinstance(calls, list):
            msg["tool_calls"] = [_parsed_call(c) for c in calls]
        out.append(msg)
    return out


def _reasoning(m: Mapping[str, Any]) -> str | None:
    r = m.get("reasoning")
    if r is None:
        r = m.get("reasoning_content")
    return r if isinstance(r, str) else None


def _parsed_call(call: Any) -> Any:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict):
        return call
    args = fn.get("arguments")
    if isinstance(args, str) and args:
        args = safejson.try_loads(args)[1]
    if not isinstance(args, dict):
        args = {}
    return {**call, "function": {**fn, "arguments": args}}


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
    def __init__(self, source: str, special_tokens: Mapping[str, str | None] | None = None,
                 sandbox: bool = True, fast: bool = True) -> None:
        """``fast`` False: always Jinja (the reference the fast renderer is tested against)."""
        self.source = source
        self._compiled = compile_template(source, sandbox)
        self._special = dict(special_tokens or {})
        self._fast = renderer_for(source) if fast else None
        """A known template's renderer in plain Python (``render_qwen3.py``); Jinja renders what it declines."""

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
            msgs, norm_tools = normalize_messages(messages), normalize_tools(tools)
            if self._fast is not None \
                    and (text := self._fast(msgs, norm_tools, add_generation_prompt, kwargs)) is not None:
                return text
            return self._compiled.render(
                messages=msgs,
                tools=norm_tools,
                add_generation_prompt=add_generation_prompt,
                **kwargs,
            )
        except TemplateError:
            raise
        except (jinja2.TemplateError, TypeError, AttributeError, KeyError) as exc:
            raise TemplateError(f"chat template failed: {exc}") from exc
