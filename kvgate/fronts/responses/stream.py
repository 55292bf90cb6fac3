"""The chat SSE stream as the Responses event sequence: ``response.created``, ``response.in_progress``,
then per output item ``output_item.added`` → (``content_part.added`` → text deltas → ``.done`` →
``content_part.done``) or argument deltas → ``output_item.done``, then ``response.completed`` (or
``response.incomplete`` when the output hit ``max_output_tokens``, ``response.failed`` when the worker
was lost), every event with its ``sequence_number``. Items come in the order the worker streams them:
reasoning, then the message, then function calls."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from kvgate.fronts.responses import translate as t
from kvgate.fronts.responses.translate import Request
from kvgate.gateway.sse import SseSplitter


class Events:
    """The Responses events of one chat stream, fed one chat chunk at a time."""

    def __init__(self, req: Request, resp_id: str, chat_id: str, created: float) -> None:
        self.req = req
        self.resp_id = resp_id
        self.chat_id = chat_id
        self.created = created
        self.seq = 0
        self.output: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None
        """The item being streamed (reasoning, message or function_call)."""
        self.calls: dict[int, dict[str, Any]] = {}
        self.usage: dict[str, Any] | None = None
        self.finish: str | None = None

    def event(self, kind: str, **fields: Any) -> bytes:
        obj = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: ".encode() + json.dumps(obj).encode() + b"\n\n"

    def start(self) -> list[bytes]:
        r = t.response_object(self.req, self.resp_id, [], "in_progress", None, self.created)
        return [self.event("response.created", response=r), self.event("response.in_progress", response=r)]

    def chunk(self, obj: dict[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        if "usage" in obj and t.usage(obj.get("usage")) is not None:
            self.usage = t.usage(obj["usage"])
        choices = obj.get("choices")
        for ch in choices if isinstance(choices, list) else []:
            if not isinstance(ch, dict) or ch.get("index", 0) != 0:
                continue
            delta = ch.get("delta")
            if isinstance(delta, dict):
                out += self._delta(delta)
            if ch.get("finish_reason"):
                self.finish = str(ch["finish_reason"])
        return out

    def _delta(self, d: dict[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        reasoning = d.get("reasoning") or d.get("reasoning_content")
        if isinstance(reasoning, str) and reasoning:
            out += self._text("reasoning", reasoning)
        if isinstance(d.get("content"), str) and d["content"]:
            out += self._text("message", d["content"])
        for tc in d.get("tool_calls") or []:
            if isinstance(tc, dict):
                out += self._call(tc)
        return out

    def _text(self, kind: str, text: str) -> list[bytes]:
        out: list[bytes] = []
        if self.open is None or self.open["type"] != kind:
            out += self._close()
            item = t.reasoning_item(self.chat_id, "", "in_progress") if kind == "reasoning" \
                else t.message_item(self.chat_id, "", "in_progress")
            part = dict(item["content"][0])
            item["content"] = []
            self.open = {"type": kind, "item": item, "part": part, "text": "", "index": len(self.output)}
            out.append(self.event("response.output_item.added", output_index=len(self.output), item=item))
            out.append(self.event("response.content_part.added", item_id=item["id"], output_index=len(self.output),
                                  content_index=0, part=part))
        o = self.open
        o["text"] += text
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra: dict[str, Any] = {} if kind == "reasoning" else {"logprobs": []}
        out.append(self.event(name, item_id=o["item"]["id"], output_index=o["index"], content_index=0, delta=text,
                              **extra))
        return out

    def _call(self, tc: dict[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        idx = tc.get("index", len(self.calls))
        idx = idx if isinstance(idx, int) else len(self.calls)
        fn = tc.get("function") if isinstance(tc.get("function"), dict) else {}
        assert isinstance(fn, dict)
        if self.open is None or self.open.get("call") != idx:
            out += self._close()
            call_id = t.text_or(tc.get("id"), f"call_{self.chat_id}_{idx}")
            item = t.call_item(call_id, str(fn.get("name") or ""), "", "in_progress")
            self.open = {"type": "function_call", "call": idx, "item": item, "index": len(self.output)}
            out.append(self.event("response.output_item.added", output_index=len(self.output), item=item))
        o = self.open
        args = fn.get("arguments")
        if isinstance(args, str) and args:
            o["item"]["arguments"] += args
            out.append(self.event("response.function_call_arguments.delta", item_id=o["item"]["id"],
                                  output_index=o["index"], delta=args))
        return out

    def _close(self) -> list[bytes]:
        o, self.open = self.open, None
        if o is None:
            return []
        item, i = o["item"], o["index"]
        out: list[bytes] = []
        if o["type"] == "function_call":
            out.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                                  arguments=item["arguments"], name=item["name"]))
        else:
            part = {**o["part"], "text": o["text"]}
            done = "response.reasoning_text.done" if o["type"] == "reasoning" else "response.output_text.done"
            extra: dict[str, Any] = {} if o["type"] == "reasoning" else {"logprobs": []}
            out.append(self.event(done, item_id=item["id"], output_index=i, content_index=0, text=o["text"], **extra))
            out.append(self.event("response.content_part.done", item_id=item["id"], output_index=i, content_index=0,
                                  part=part))
            item["content"] = [part]
        item["status"] = "completed"
        self.output.append(item)
        out.append(self.event("response.output_item.done", output_index=i, item=item))
        return out

    def end(self) -> tuple[list[bytes], dict[str, Any]]:
        out = self._close()
        r = t.response_object(self.req, self.resp_id, self.output, "completed", self.usage, self.created, self.finish)
        kind = "response.incomplete" if r["status"] == "incomplete" else "response.completed"
        out.append(self.event(kind, response=r))
        return out, r

    def failed(self, message: str, code: Any) -> list[bytes]:
        out = self._close()
        r = t.response_object(self.req, self.resp_id, self.output, "failed", self.usage, self.created)
        r["error"] = {"code": "server_error" if code is None else str(code), "message": message}
        out.append(self.event("response.failed", response=r))
        return out


async def translate_stream(chunks: AsyncIterator[bytes], req: Request, created: float,
                           done: Callable[[dict[str, Any]], Awaitable[None]]) -> AsyncIterator[bytes]:
    """``done``: called with the completed response object once the chat stream has ended (the relay has
    recorded the turn by then), before ``response.completed`` is sent."""
    splitter = SseSplitter()
    ev: Events | None = None
    async for raw in chunks:
        for sse in splitter.feed(raw):
            obj = sse.json()
            if obj is None:
                continue
            if isinstance(obj.get("error"), dict):
                err = obj["error"]
                ev = ev or Events(req, t.response_id("failed"), "failed", created)
                out = ev.start() if ev.seq == 0 else []
                for b in out + ev.failed(str(err.get("message") or "the worker failed"), err.get("code")):
                    yield b
                return
            if ev is None:
                chat_id = t.text_or(obj.get("id"), "unknown")
                ev = Events(req, t.response_id(chat_id), chat_id, created)
                for b in ev.start():
                    yield b
            for b in ev.chunk(obj):
                yield b
    if ev is None:  # the worker sent nothing: nothing to answer with but a failure
        ev = Events(req, t.response_id("failed"), "failed", created)
        for b in ev.start() + ev.failed("the worker's stream ended without output", None):
            yield b
        return
    out, resp = ev.end()
    await done(resp)
    for b in out:
        yield b
