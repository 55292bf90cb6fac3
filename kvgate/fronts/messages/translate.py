"""An Anthropic Messages request as a Chat Completions body, and a chat answer as a Messages answer. Pure.

Request: ``system`` becomes the system message; an assistant turn's thinking, text and tool_use blocks
become one assistant message (``reasoning``, ``content``, ``tool_calls`` with the tool_use id and the
input as JSON); a user turn's tool_result blocks become ``tool`` messages in order, its text a user
message after them. A thinking block must carry the signature kvgate gave it (signing.py), so what reaches
the engine is the reasoning it generated, byte for byte. ``redacted_thinking`` is dropped: it is
Anthropic's encrypted reasoning, which neither kvgate nor the engine can read, and the engine never cached
it. ``cache_control`` markers are accepted and not forwarded: the engine caches every prefix anyway (how long
kvgate keeps the conversation's KV for them is read beside the translation: ``session/retention.py``).

Answer: reasoning becomes a signed thinking block, content a text block, tool calls tool_use blocks;
usage counts ``input_tokens`` as the uncached prompt tokens and ``cache_read_input_tokens`` as the
engine's cached ones, as Anthropic counts.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from kvgate import safejson
from kvgate.errors import BadRequest
from kvgate.fronts.messages.signing import Signer

IGNORED = frozenset({"service_tier", "inference_geo", "speed", "diagnostics", "cache_control", "user_profile_id",
                     "workspace_id"})
"""Anthropic fields that ask for nothing a self-hosted engine does differently: accepted, not forwarded."""

REFUSED = frozenset({"container", "mcp_servers", "context_management", "output_format"})
"""Anthropic features kvgate cannot provide (server-side containers, MCP, context editing, structured output)."""

THREAD_UNSUPPORTED = "thread_unsupported_request"
"""The error code of Anthropic's refusal to thread a request (``error.details.error_code``), on which the SDK's
threaded clients fall back to sending the whole history."""

CHAT_ONLY = frozenset({"n", "stream_options", "logprobs", "top_logprobs", "response_format", "functions",
                       "function_call", "stop", "max_completion_tokens", "parallel_tool_calls", "prompt",
                       "previous_response_id", "logit_bias", "tool_calls", "modalities", "audio", "prediction",
                       "store", "reasoning_effort", "chat_template_kwargs", "continue_final_message",
                       "add_generation_prompt"})
"""Chat Completions fields the Messages door sets itself or that would change the answer's shape:
refused rather than passed through. Any other unknown field passes through to the worker (vLLM and SGLang
extensions, kvgate's ``conversation_id`` / ``reasoning_policy``, the simulator's ``sim``)."""

KNOWN = frozenset({"model", "messages", "system", "max_tokens", "stop_sequences", "temperature", "top_p", "top_k",
                   "metadata", "stream", "tools", "tool_choice", "thinking", "output_config"})

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "function_call": "tool_use",
                "content_filter": "refusal"}


def _bad(message: str, param: str | None = None) -> BadRequest:
    return BadRequest(message, param=param, code="invalid_request_error")


def _str(v: Any, param: str, empty: bool = True) -> str:
    if not isinstance(v, str) or (not empty and not v):
        raise _bad(f"{param}: Input should be a {'' if empty else 'non-empty '}string", param)
    return v


def _int(v: Any, param: str, low: int) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < low:
        raise _bad(f"{param}: Input should be an integer of at least {low}", param)
    return v


def _number(v: Any, param: str) -> float:
    if not isinstance(v, int | float) or isinstance(v, bool):
        raise _bad(f"{param}: Input should be a number", param)
    return v


def _dict(v: Any, param: str) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise _bad(f"{param}: Input should be an object", param)
    return v


def _list(v: Any, param: str) -> list[Any]:
    if not isinstance(v, list):
        raise _bad(f"{param}: Input should be an array", param)
    return v


def to_chat(body: Mapping[str, Any], signer: Signer, count: bool = False) -> dict[str, Any]:
    """The chat body for a Messages request (``count``: a count_tokens request, which has no ``max_tokens``)."""
    out: dict[str, Any] = {"model": _str(body.get("model"), "model", empty=False)}
    for k, v in body.items():
        if k in REFUSED:
            raise _bad(f"{k}: not supported by this gateway", k)
        if k == "thread":
            if v is None:
                continue
            # The message-threads beta (the SDK's tool runner sends it by default) keeps the history on the
            # server and sends only the new messages. kvgate answers as Anthropic does for a request it
            # cannot thread: the SDK then drops `thread` and resends the whole history, which kvgate caches.
            raise BadRequest("thread: message threads are not supported by this gateway; send the full history",
                             param="thread", code=THREAD_UNSUPPORTED)
        if k in CHAT_ONLY:
            raise _bad(f"{k}: Extra inputs are not permitted (a Chat Completions field, not a Messages one)", k)
        if k not in KNOWN and k not in IGNORED:
            out[k] = v
    if not count:
        out["max_tokens"] = _int(body.get("max_tokens"), "max_tokens", 1)
    thinking = _thinking(body.get("thinking"), out.get("max_tokens"))
    if thinking is not None:
        out["chat_template_kwargs"] = {"enable_thinking": thinking}
    system = _system(body.get("system"))
    raw = body.get("messages")
    msgs = _list(raw, "messages")
    if not msgs:
        raise _bad("messages: at least one message is required", "messages")
    out["messages"] = ([{"role": "system", "content": system}] if system is not None else []) + \
        _messages(msgs, signer)
    _sampling(body, out)
    tools = body.get("tools")
    if tools is not None:
        out["tools"] = [_tool(t, f"tools.{i}") for i, t in enumerate(_list(tools, "tools"))]
    if body.get("tool_choice") is not None:
        out.update(_tool_choice(body["tool_choice"]))
    meta = body.get("metadata")
    if meta is not None:
        uid = _dict(meta, "metadata").get("user_id")
        if uid is not None:
            # Kept for kvgate's identity (a body key, gateway/identity.py); engines ignore the field.
            out["metadata"] = {"user_id": _str(uid, "metadata.user_id")}
    oc = body.get("output_config")
    if oc is not None and _dict(oc, "output_config").get("format") is not None:
        raise _bad("output_config.format: structured output is not supported by this gateway", "output_config.format")
    if body.get("stream") is not None:
        if not isinstance(body["stream"], bool):
            raise _bad("stream: Input should be a valid boolean", "stream")
        if body["stream"] and not count:
            # The Messages stream ends with usage (message_delta): ask the worker for it.
            out["stream"] = True
            out["stream_options"] = {"include_usage": True}
    return out


def _sampling(body: Mapping[str, Any], out: dict[str, Any]) -> None:
    for k in ("temperature", "top_p"):
        if body.get(k) is not None:
            out[k] = _number(body[k], k)
    if body.get("top_k") is not None:
        out["top_k"] = _int(body["top_k"], "top_k", 0)
    stops = body.get("stop_sequences")
    if stops is not None:
        out["stop"] = [_str(s, f"stop_sequences.{i}", empty=False)
                       for i, s in enumerate(_list(stops, "stop_sequences"))]


def _thinking(v: Any, max_tokens: int | None) -> bool | None:
    """The chat template's ``enable_thinking``, or None to leave the model's default."""
    if v is None:
        return None
    kind = _dict(v, "thinking").get("type")
    if kind == "disabled":
        return False
    if kind == "adaptive":
        return True
    if kind != "enabled":
        raise _bad("thinking.type: Input should be 'enabled', 'disabled' or 'adaptive'", "thinking.type")
    budget = _int(v.get("budget_tokens"), "thinking.budget_tokens", 1024)
    if max_tokens is not None and budget >= max_tokens:
        raise _bad("`max_tokens` must be greater than `thinking.budget_tokens`", "thinking.budget_tokens")
    return True


def _system(v: Any) -> str | None:
    if v is None or isinstance(v, str):
        return v
    parts = []
    for i, b in enumerate(_list(v, "system")):
        b = _dict(b, f"system.{i}")
        if b.get("type") != "text":
            raise _bad(f"system.{i}.type: Input should be 'text'", f"system.{i}.type")
        parts.append(_str(b.get("text"), f"system.{i}.text"))
    return "\n".join(parts)  # how vLLM joins a system message's text parts for the template


def _blocks(content: Any, param: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    return [_dict(b, f"{param}.{j}") for j, b in enumerate(_list(content, param))]


def _messages(msgs: list[Any], signer: Signer) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    pending: list[str] = []  # the tool_use ids of the previous assistant message, awaiting their results
    for i, m in enumerate(msgs):
        m = _dict(m, f"messages.{i}")
        role = m.get("role")
        blocks = _blocks(m.get("content"), f"messages.{i}.content")
        if role == "assistant":
            if pending:
                raise _tool_use_without_result(i - 1, pending)
            msg, pending = _assistant(blocks, i, signer)
            out.append(msg)
        elif role == "user":
            out += _user(blocks, i, pending)
            pending = []
        else:
            raise _bad(f"messages.{i}.role: Input should be 'user' or 'assistant'", f"messages.{i}.role")
    if msgs and isinstance(msgs[-1], dict) and msgs[-1].get("role") == "assistant":
        # The template would have to continue that message (vLLM's continue_final_message); kvgate renders
        # every prompt with a generation prompt after the last message, as it routes and caches it.
        raise _bad(f"messages.{len(msgs) - 1}: a final assistant message (prefill) is not supported by this "
                   "gateway", f"messages.{len(msgs) - 1}")
    return out


def _tool_use_without_result(i: int, ids: list[str]) -> BadRequest:
    return _bad(f"messages.{i}: `tool_use` ids were found without `tool_result` blocks immediately after: "
                f"{', '.join(ids[:5])}. Each `tool_use` block must have a corresponding `tool_result` block in "
                "the next message.", f"messages.{i}")


def _assistant(blocks: list[dict[str, Any]], i: int, signer: Signer) -> tuple[dict[str, Any], list[str]]:
    text: list[str] = []
    thinking: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, b in enumerate(blocks):
        p = f"messages.{i}.content.{j}"
        kind = b.get("type")
        if kind == "text":
            text.append(_str(b.get("text"), f"{p}.text"))
        elif kind == "thinking":
            t = _str(b.get("thinking"), f"{p}.thinking")
            if not signer.verify(t, _str(b.get("signature"), f"{p}.signature")):
                raise _bad(f"{p}: Invalid `signature` in `thinking` block", f"{p}.signature")
            thinking.append(t)
        elif kind == "redacted_thinking":
            _str(b.get("data"), f"{p}.data")  # Anthropic's encrypted reasoning: unreadable here, dropped
        elif kind == "tool_use":
            inp = _dict(b.get("input"), f"{p}.input")
            calls.append({"id": _str(b.get("id"), f"{p}.id", empty=False), "type": "function",
                          "function": {"name": _str(b.get("name"), f"{p}.name", empty=False),
                                       "arguments": json.dumps(inp, ensure_ascii=False)}})
        else:
            raise _unsupported(kind, p)
    msg: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
    if thinking:
        msg["reasoning"] = "".join(thinking)
    if calls:
        msg["tool_calls"] = calls
    ids = [c["id"] for c in calls]
    if len(set(ids)) != len(ids):
        raise _bad(f"messages.{i}: `tool_use` ids must be unique", f"messages.{i}")
    return msg, ids


def _user(blocks: list[dict[str, Any]], i: int, pending: list[str]) -> list[dict[str, Any]]:
    tools: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    awaited = set(pending)  # a hostile turn may carry thousands of calls: no scan per result
    for j, b in enumerate(blocks):
        p = f"messages.{i}.content.{j}"
        kind = b.get("type")
        if kind == "text":
            parts.append({"type": "text", "text": _str(b.get("text"), f"{p}.text")})
        elif kind == "tool_result":
            tid = _str(b.get("tool_use_id"), f"{p}.tool_use_id", empty=False)
            if tid not in awaited:
                raise _bad(f"{p}: unexpected `tool_use_id` found in `tool_result` blocks: {tid[:64]}. Each "
                           "`tool_result` block must have a corresponding `tool_use` block in the previous "
                           "message.", f"{p}.tool_use_id")
            tools.append({"role": "tool", "tool_call_id": tid, "content": _result(b, p)})
        else:
            raise _unsupported(kind, p)
    done = {t["tool_call_id"] for t in tools}
    missing = [t for t in pending if t not in done]
    if missing:
        raise _tool_use_without_result(i - 1, missing)
    if not parts:
        return tools
    content: str | list[dict[str, Any]] = parts[0]["text"] if len(parts) == 1 else parts
    return [*tools, {"role": "user", "content": content}]


def _result(b: dict[str, Any], p: str) -> str:
    c = b.get("content")
    if c is None:
        text = ""
    elif isinstance(c, str):
        text = c
    else:
        texts = []
        for k, part in enumerate(_list(c, f"{p}.content")):
            part = _dict(part, f"{p}.content.{k}")
            if part.get("type") != "text":
                raise _unsupported(part.get("type"), f"{p}.content.{k}")
            texts.append(_str(part.get("text"), f"{p}.content.{k}.text"))
        text = "\n".join(texts)
    err = b.get("is_error")
    if err is not None and not isinstance(err, bool):
        raise _bad(f"{p}.is_error: Input should be a valid boolean", f"{p}.is_error")
    # A chat tool message has no error flag: say it in the text, so the model still learns the call failed.
    return f"Error: {text}" if err else text


def _unsupported(kind: Any, p: str) -> BadRequest:
    if kind in ("image", "document", "search_result"):
        return _bad(f"{p}: `{kind}` content blocks are not supported by this gateway (text models only)", p)
    shown = kind[:64] if isinstance(kind, str) else type(kind).__name__
    return _bad(f"{p}.type: content block type `{shown}` is not supported here", f"{p}.type")


def _tool(t: Any, p: str) -> dict[str, Any]:
    t = _dict(t, p)
    kind = t.get("type")
    if kind not in (None, "custom"):
        shown = kind[:64] if isinstance(kind, str) else type(kind).__name__
        raise _bad(f"{p}.type: server tool `{shown}` is not supported by this gateway (custom tools only)",
                   f"{p}.type")
    fn: dict[str, Any] = {"name": _str(t.get("name"), f"{p}.name", empty=False)}
    if t.get("description") is not None:
        fn["description"] = _str(t["description"], f"{p}.description")
    fn["parameters"] = _dict(t.get("input_schema"), f"{p}.input_schema")
    return {"type": "function", "function": fn}


def _tool_choice(v: Any) -> dict[str, Any]:
    v = _dict(v, "tool_choice")
    kind = v.get("type")
    out: dict[str, Any]
    if kind == "auto":
        out = {"tool_choice": "auto"}
    elif kind == "any":
        out = {"tool_choice": "required"}
    elif kind == "none":
        out = {"tool_choice": "none"}
    elif kind == "tool":
        out = {"tool_choice": {"type": "function", "function": {"name": _str(v.get("name"), "tool_choice.name",
                                                                               empty=False)}}}
    else:
        raise _bad("tool_choice.type: Input should be 'auto', 'any', 'tool' or 'none'", "tool_choice.type")
    dp = v.get("disable_parallel_tool_use")
    if dp is not None:
        if not isinstance(dp, bool):
            raise _bad("tool_choice.disable_parallel_tool_use: Input should be a valid boolean",
                       "tool_choice.disable_parallel_tool_use")
        if dp and kind != "none":
            out["parallel_tool_calls"] = False
    return out


# -- the answer ------------------------------------------------------------------------------------------


def message_id(chat_id: Any) -> str:
    return "msg_" + (chat_id if isinstance(chat_id, str) and chat_id else "kvgate")


def usage(u: Any) -> dict[str, int]:
    """Anthropic's usage from a chat usage object: uncached input, cache reads, output."""
    u = u if isinstance(u, dict) else {}
    details = u.get("prompt_tokens_details")
    cached = _count(details.get("cached_tokens") if isinstance(details, dict) else 0)
    prompt = _count(u.get("prompt_tokens"))
    # The engine writes every uncached prefix block to its cache unasked; Anthropic's "cache creation" is
    # a write at a cache_control breakpoint, which does not happen here: 0, as vLLM's own Messages door says.
    return {"input_tokens": max(0, prompt - cached), "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached, "output_tokens": _count(u.get("completion_tokens"))}


def _count(v: Any) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else 0


def stop_reason(finish: Any, matched: Any, tool_calls: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) from a chat choice's finish_reason and vLLM's ``stop_reason`` (the stop
    string it matched, or a stop token id)."""
    if tool_calls and finish in ("tool_calls", "stop", None):
        return "tool_use", None
    if finish == "stop" and isinstance(matched, str):
        return "stop_sequence", matched
    return STOP_REASONS.get(finish, "end_turn") if isinstance(finish, str) else "end_turn", None


def tool_input(arguments: Any) -> dict[str, Any]:
    if isinstance(arguments, dict):
        return arguments
    if isinstance(arguments, str) and arguments.strip():
        ok, doc = safejson.try_loads(arguments)
        if ok and isinstance(doc, dict):
            return doc
    return {}


def from_chat(obj: Mapping[str, Any], signer: Signer) -> dict[str, Any]:
    choices = obj.get("choices")
    choice: dict[str, Any] = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) \
        else {}
    msg: dict[str, Any] = choice["message"] if isinstance(choice.get("message"), dict) else {}
    content: list[dict[str, Any]] = []
    reasoning = msg.get("reasoning") or msg.get("reasoning_content")
    if isinstance(reasoning, str) and reasoning:
        content.append({"type": "thinking", "thinking": reasoning, "signature": signer.sign(reasoning)})
    text = msg.get("content")
    if isinstance(text, str) and text:
        content.append({"type": "text", "text": text})
    calls: list[Any] = msg["tool_calls"] if isinstance(msg.get("tool_calls"), list) else []
    for c in calls:
        fn: dict[str, Any] = c["function"] if isinstance(c, dict) and isinstance(c.get("function"), dict) else {}
        content.append({"type": "tool_use", "id": c.get("id") if isinstance(c, dict) else None,
                        "name": fn.get("name"), "input": tool_input(fn.get("arguments"))})
    reason, seq = stop_reason(choice.get("finish_reason"), choice.get("stop_reason"), bool(calls))
    return {"id": message_id(obj.get("id")), "type": "message", "role": "assistant", "model": obj.get("model"),
            "content": content, "stop_reason": reason, "stop_sequence": seq, "usage": usage(obj.get("usage"))}
