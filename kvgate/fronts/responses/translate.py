"""A Responses request read and checked, its chat body, and a chat answer as a response. Pure (the input
items' messages: ``items.py``). What the chat pipeline cannot carry is refused (400), never dropped."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvgate.errors import BadRequest

MAX_ITEMS = 4096
"""Input items in one request (the chat door's own message limits apply after translation too)."""

REFUSED_FIELDS = {
    "background": "background responses are not supported by kvgate",
    "conversation": "the Conversations API is not supported by kvgate; use previous_response_id or resend the input",
    "prompt": "prompt templates are not supported by kvgate",
}
"""Responses fields kvgate cannot honour: a clear 400 rather than an answer that ignored them."""

HANDLED_FIELDS = frozenset({
    "model", "input", "instructions", "tools", "tool_choice", "store", "previous_response_id", "reasoning",
    "max_output_tokens", "temperature", "top_p", "metadata", "parallel_tool_calls", "stream", "stream_options",
    "text", "include", "truncation", "user", "service_tier", "safety_identifier", "prompt_cache_retention",
    "top_logprobs", "max_tool_calls",
})
"""Read here; any other field goes to the chat body unchanged (``sim``, ``prompt_cache_key``, vLLM's
extensions), as the chat door forwards fields it does not know."""

CHAT_PASSTHROUGH = ("temperature", "top_p", "parallel_tool_calls", "user", "top_logprobs")


@dataclass(slots=True)
class Request:
    """What a Responses request asked for, read and checked."""

    model: str
    items: list[dict[str, Any]]
    """The input as items (a string input: one user message)."""
    instructions: str | None
    tools: list[dict[str, Any]]
    tool_choice: Any
    store: bool
    previous: str | None
    stream: bool
    metadata: dict[str, Any] | None
    echo: dict[str, Any] = field(default_factory=dict)
    """Request fields the response object repeats (temperature, top_p, reasoning, ...)."""


def text_or(v: Any, default: str) -> str:
    """``v`` if it is a non-empty string, else ``default``."""
    return v if isinstance(v, str) and v else default


def bad(message: str, param: str | None = None, code: str = "invalid_value") -> BadRequest:
    return BadRequest(message, param=param, code=code)


def read_request(body: Mapping[str, Any]) -> Request:
    for name, why in REFUSED_FIELDS.items():
        if body.get(name) not in (None, False):
            raise bad(f"'{name}': {why}.", name, "unsupported_parameter")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("'model' is required (a non-empty string).", "model", "missing_required_parameter")
    raw = body.get("input")
    if isinstance(raw, str):
        items: list[dict[str, Any]] = [{"type": "message", "role": "user",
                                        "content": [{"type": "input_text", "text": raw}]}]
    elif isinstance(raw, list):
        if not raw:
            raise bad("'input' must not be empty.", "input")
        if len(raw) > MAX_ITEMS:
            raise bad(f"'input' has {len(raw)} items; at most {MAX_ITEMS} are accepted.", "input")
        for i, it in enumerate(raw):
            if not isinstance(it, dict):
                raise bad(f"'input[{i}]' must be an object.", f"input[{i}]")
        items = list(raw)
    else:
        raise bad("'input' is required: a string or an array of input items.", "input",
                  "missing_required_parameter")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad("'instructions' must be a string.", "instructions")
    store = body.get("store", True)
    previous = body.get("previous_response_id")
    if not isinstance(store, bool) and store is not None:
        raise bad("'store' must be a boolean.", "store")
    if previous is not None and (not isinstance(previous, str) or not previous):
        raise bad("'previous_response_id' must be a non-empty string.", "previous_response_id")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise bad("'stream' must be a boolean.", "stream")
    metadata = body.get("metadata")
    if metadata is not None and not (isinstance(metadata, dict) and len(metadata) <= 16
                                     and all(isinstance(v, str) for v in metadata.values())):
        raise bad("'metadata' must be an object of at most 16 string values.", "metadata")
    echo = {k: body[k] for k in ("temperature", "top_p", "max_output_tokens", "reasoning", "text", "truncation",
                                 "user", "parallel_tool_calls", "top_logprobs") if body.get(k) is not None}
    return Request(model, items, instructions, read_tools(body.get("tools")), body.get("tool_choice", "auto"),
                   store is not False, previous, bool(stream), metadata, echo)


def read_tools(tools: Any) -> list[dict[str, Any]]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise bad("'tools' must be an array.", "tools")
    for i, t in enumerate(tools):
        kind = t.get("type") if isinstance(t, dict) else None
        if kind != "function":
            raise bad(f"'tools[{i}]': only function tools are supported by kvgate (got type {kind!r}); "
                      "built-in tools (web search, file search, computer use, MCP, ...) are not.",
                      f"tools[{i}].type", "unsupported_tool")
        assert isinstance(t, dict)
        if not isinstance(t.get("name"), str) or not t["name"]:
            raise bad(f"'tools[{i}].name' is required (a non-empty string).", f"tools[{i}].name")
        if t.get("parameters") is not None and not isinstance(t["parameters"], dict):
            raise bad(f"'tools[{i}].parameters' must be an object (a JSON schema).", f"tools[{i}].parameters")
        if t.get("description") is not None and not isinstance(t["description"], str):
            raise bad(f"'tools[{i}].description' must be a string.", f"tools[{i}].description")
    return list(tools)


def chat_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for t in tools:
        fn: dict[str, Any] = {"name": t["name"]}
        if t.get("description") is not None:
            fn["description"] = t["description"]
        fn["parameters"] = t.get("parameters") if t.get("parameters") is not None else {"type": "object"}
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: Any) -> Any:
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad("'tool_choice' must be 'auto', 'none', 'required' or {\"type\": \"function\", \"name\": ...}.",
              "tool_choice")


def response_format(text: Any) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format`` (None: plain text)."""
    if text is None:
        return None
    fmt = text.get("format") if isinstance(text, dict) else None
    if not isinstance(text, dict) or (fmt is not None and not isinstance(fmt, dict)):
        raise bad("'text' must be an object with an optional 'format' object.", "text")
    kind = fmt.get("type") if fmt else "text"
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema" and fmt is not None and isinstance(fmt.get("schema"), dict):
        schema = {"name": fmt.get("name") or "response", "schema": fmt["schema"]}
        if fmt.get("strict") is not None:
            schema["strict"] = bool(fmt["strict"])
        return {"type": "json_schema", "json_schema": schema}
    raise bad("'text.format.type' must be 'text', 'json_object' or 'json_schema' (with a schema object).",
              "text.format")


def chat_body(req: Request, body: Mapping[str, Any], messages: list[dict[str, Any]], previous_chat_id: str | None
              ) -> dict[str, Any]:
    """The chat body of a Responses request whose input became ``messages``."""
    chat: dict[str, Any] = {k: v for k, v in body.items() if k not in HANDLED_FIELDS and k not in REFUSED_FIELDS}
    chat.update(model=req.model, messages=messages)
    if req.tools:
        chat["tools"] = chat_tools(req.tools)
        chat["tool_choice"] = chat_tool_choice(req.tool_choice)
    elif req.tool_choice not in (None, "auto", "none"):
        raise bad("'tool_choice' names a tool but no tools were given.", "tool_choice")
    for k in CHAT_PASSTHROUGH:
        if body.get(k) is not None:
            chat[k] = body[k]
    if body.get("max_output_tokens") is not None:
        n = body["max_output_tokens"]
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise bad("'max_output_tokens' must be a positive integer.", "max_output_tokens")
        chat["max_tokens"] = n
    effort = _effort(body.get("reasoning"))
    if effort is not None:
        chat["reasoning_effort"] = effort
    fmt = response_format(body.get("text"))
    if fmt is not None:
        chat["response_format"] = fmt
    if previous_chat_id is not None:
        chat["previous_response_id"] = previous_chat_id
    if not req.store:
        chat["store"] = False  # the pipeline then records no response id (nothing continues from it)
    if req.stream:
        # kvgate needs the usage chunk to build response.completed; asked for, so the relay passes it on.
        chat.update(stream=True, stream_options={"include_usage": True})
    return chat


def _effort(reasoning: Any) -> str | None:
    if reasoning is None:
        return None
    if not isinstance(reasoning, dict):
        raise bad("'reasoning' must be an object.", "reasoning")
    effort = reasoning.get("effort")
    if effort is not None and not isinstance(effort, str):
        raise bad("'reasoning.effort' must be a string.", "reasoning.effort")
    return effort


def input_item_list(items: list[dict[str, Any]], resp_id: str) -> list[dict[str, Any]]:
    """The request's input items as ``input_items`` lists them: each with an id."""
    out = []
    for i, it in enumerate(items):
        item = dict(it)
        if item.get("type") is None and "role" in item:
            item["type"] = "message"
        if item.get("type") == "message" and isinstance(item.get("content"), str):
            part = "output_text" if item.get("role") == "assistant" else "input_text"
            item["content"] = [{"type": part, "text": item["content"]}]
        item.setdefault("id", f"item_{resp_id.removeprefix('resp_')}_{i}")
        out.append(item)
    return out


# -- chat answer -> response ---------------------------------------------------------------------------

RESP_PREFIX = "resp_"


def response_id(chat_id: str) -> str:
    """A response id names the worker's chat completion id the conversation record keeps, so any replica
    sharing the store continues it."""
    return RESP_PREFIX + chat_id


def chat_id_of(resp_id: str) -> str | None:
    return (resp_id[len(RESP_PREFIX):] or None) if resp_id.startswith(RESP_PREFIX) else None


def reasoning_item(chat_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"id": f"rs_{chat_id}", "type": "reasoning", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": status}


def message_item(chat_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"id": f"msg_{chat_id}", "type": "message", "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def call_item(call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {"id": f"fc_{call_id}", "type": "function_call", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def output_items(chat_id: str, message: Mapping[str, Any]) -> list[dict[str, Any]]:
    out = []
    reasoning = message.get("reasoning") or message.get("reasoning_content")
    if isinstance(reasoning, str) and reasoning:
        out.append(reasoning_item(chat_id, reasoning))
    content = message.get("content")
    if isinstance(content, str) and content:
        out.append(message_item(chat_id, content))
    for n, c in enumerate(message.get("tool_calls") or []):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict):
            continue
        call_id = text_or(c.get("id"), f"call_{chat_id}_{n}")
        args = fn.get("arguments")
        out.append(call_item(call_id, str(fn.get("name") or ""), args if isinstance(args, str) else "{}"))
    return out


def usage(chat_usage: Any) -> dict[str, Any] | None:
    if not isinstance(chat_usage, dict):
        return None
    pt = _int(chat_usage.get("prompt_tokens"))
    ct = _int(chat_usage.get("completion_tokens"))
    pd = chat_usage.get("prompt_tokens_details")
    cd = chat_usage.get("completion_tokens_details")
    cached = _int(pd.get("cached_tokens")) if isinstance(pd, dict) else 0
    reasoning = _int(cd.get("reasoning_tokens")) if isinstance(cd, dict) else 0
    return {"input_tokens": pt, "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": ct, "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": pt + ct}


def _int(v: Any) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else 0


def response_object(req: Request, resp_id: str, output: list[dict[str, Any]], status: str,
                    use: dict[str, Any] | None, created: float | None = None,
                    finish_reason: str | None = None) -> dict[str, Any]:
    """The ``response`` object (also what ``response.created`` carries, with ``output`` empty)."""
    incomplete = {"reason": "max_output_tokens"} if finish_reason == "length" else None
    if incomplete is not None and status == "completed":
        status = "incomplete"
    e = req.echo
    return {
        "id": resp_id, "object": "response", "created_at": int(created if created is not None else time.time()),
        "status": status, "error": None, "incomplete_details": incomplete, "instructions": req.instructions,
        "max_output_tokens": e.get("max_output_tokens"), "model": req.model, "output": output,
        "parallel_tool_calls": e.get("parallel_tool_calls", True), "previous_response_id": req.previous,
        "reasoning": e.get("reasoning"), "store": req.store, "temperature": e.get("temperature"),
        "text": e.get("text") or {"format": {"type": "text"}}, "tool_choice": req.tool_choice or "auto",
        "tools": req.tools, "top_p": e.get("top_p"), "truncation": e.get("truncation", "disabled"),
        "usage": use, "user": e.get("user"), "metadata": req.metadata or {},
    }
