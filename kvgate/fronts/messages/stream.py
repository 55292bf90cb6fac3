"""A chat SSE stream as Anthropic's Messages event stream.

``message_start``, ``ping``, then per content block ``content_block_start`` / ``content_block_delta``
(``thinking_delta`` then ``signature_delta`` for reasoning, ``text_delta``, ``input_json_delta`` for a
tool call's arguments) / ``content_block_stop``, then ``message_delta`` (stop reason and usage) and
``message_stop``. The usage arrives in the worker's last chunk, after the finish reason, so
``message_delta`` waits for it; ``message_start`` carries zeros (Anthropic's SDK takes the
``message_delta`` figures over them). A worker lost mid-stream is an ``error`` event.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from kvgate.fronts.messages.errors import error_type
from kvgate.fronts.messages.signing import Signer
from kvgate.fronts.messages.translate import message_id, stop_reason, usage
from kvgate.gateway.sse import SseSplitter


def event(kind: str, data: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n".encode()


@dataclass
class _State:
    signer: Signer
    started: bool = False
    index: int = -1
    open: str | None = None
    """The open block's kind: thinking, text, tool_use (None: none open)."""
    thinking: list[str] = field(default_factory=list)
    tools: dict[int, int] = field(default_factory=dict)
    """Chat tool-call index -> its block's index."""
    finish: Any = None
    matched: Any = None
    usage: Any = None
    done: bool = False

    def start(self, obj: dict[str, Any]) -> list[bytes]:
        self.started = True
        msg: dict[str, Any] = {"id": message_id(obj.get("id")), "type": "message", "role": "assistant",
                               "model": obj.get("model"), "content": [], "stop_reason": None,
                               "stop_sequence": None, "usage": usage(None)}
        return [event("message_start", {"message": msg}), event("ping", {})]

    def close(self) -> list[bytes]:
        if self.open is None:
            return []
        out = []
        if self.open == "thinking":
            sig = self.signer.sign("".join(self.thinking))
            out.append(event("content_block_delta", {"index": self.index,
                                                     "delta": {"type": "signature_delta", "signature": sig}}))
            self.thinking = []
        out.append(event("content_block_stop", {"index": self.index}))
        self.open = None
        return out

    def block(self, kind: str, start: dict[str, Any]) -> list[bytes]:
        out = self.close()
        self.index += 1
        self.open = kind
        return [*out, event("content_block_start", {"index": self.index, "content_block": start})]

    def delta(self, d: dict[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        r = d.get("reasoning") or d.get("reasoning_content")
        if isinstance(r, str) and r:
            if self.open != "thinking":
                out += self.block("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            self.thinking.append(r)
            out.append(self._delta({"type": "thinking_delta", "thinking": r}))
        c = d.get("content")
        if isinstance(c, str) and c:
            if self.open != "text":
                out += self.block("text", {"type": "text", "text": ""})
            out.append(self._delta({"type": "text_delta", "text": c}))
        calls = d.get("tool_calls")
        for tc in calls if isinstance(calls, list) else []:
            if isinstance(tc, dict):
                out += self._tool(tc)
        return out

    def _tool(self, tc: dict[str, Any]) -> list[bytes]:
        k = tc.get("index", len(self.tools))
        fn: dict[str, Any] = tc["function"] if isinstance(tc.get("function"), dict) else {}
        out: list[bytes] = []
        if k not in self.tools:
            out += self.block("tool_use", {"type": "tool_use", "id": tc.get("id"), "name": fn.get("name"),
                                           "input": {}})
            self.tools[k] = self.index
        args = fn.get("arguments")
        if isinstance(args, str) and args and self.tools[k] == self.index and self.open == "tool_use":
            out.append(self._delta({"type": "input_json_delta", "partial_json": args}))
        return out

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return event("content_block_delta", {"index": self.index, "delta": delta})

    def end(self) -> list[bytes]:
        self.done = True
        reason, seq = stop_reason(self.finish, self.matched, bool(self.tools))
        return [*self.close(),
                event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": seq},
                                        "usage": usage(self.usage)}),
                event("message_stop", {})]


def _error(status: int, message: str) -> bytes:
    return event("error", {"error": {"type": error_type(status), "message": message}})


async def translate(chunks: AsyncIterator[bytes], signer: Signer) -> AsyncIterator[bytes]:
    st = _State(signer)
    splitter = SseSplitter()
    async for chunk in chunks:
        for ev in splitter.feed(chunk):
            if ev.data == "[DONE]":
                if st.started and not st.done:
                    for b in st.end():
                        yield b
                continue
            obj = ev.json()
            if obj is None or st.done:
                continue
            for b in _on_chunk(st, obj):
                yield b
            if st.done:
                return
    if not st.done:
        # Ended without [DONE]: whatever was generated is out, but the message is not whole.
        yield _error(502, "the worker's stream ended before the message was complete")


def _on_chunk(st: _State, obj: dict[str, Any]) -> list[bytes]:
    err = obj.get("error")
    if err is not None:
        st.done = True
        msg = err.get("message") if isinstance(err, dict) else err
        code = err.get("code") if isinstance(err, dict) else None
        return [_error(code if isinstance(code, int) else 502, str(msg))]
    out = [] if st.started else st.start(obj)
    if obj.get("usage") is not None:
        st.usage = obj["usage"]
    for ch in obj.get("choices") or []:
        if not isinstance(ch, dict) or ch.get("index", 0) != 0:
            continue  # n > 1 is refused at the door; a choice 0 is all there is
        if isinstance(ch.get("delta"), dict):
            out += st.delta(ch["delta"])
        if ch.get("finish_reason"):
            st.finish, st.matched = ch["finish_reason"], ch.get("stop_reason")
    return out
