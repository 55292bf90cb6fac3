"""The SSE splitter keeps events as bytes (gateway/sse.py): on streams recorded from the simulated worker
and on hand-made ones in vLLM's and SGLang's shapes, it must give the events the text-decoding splitter it
replaced gave (their bytes, data and JSON, so the usage and the reply the relay reads are the same), however
the stream is cut into chunks."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from kvgate.gateway.exchange import Usage
from kvgate.gateway.sse import SseSplitter

DATA = Path(__file__).parent / "data" / "sse"


class OldSplitter:
    """The splitter before bytes (7932694): every event decoded to text, its JSON by ``json``."""

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, chunk: bytes) -> list[tuple[bytes, str | None]]:
        self._buf += chunk.replace(b"\r\n", b"\n")
        out = []
        while True:
            i = self._buf.find(b"\n\n")
            if i < 0:
                break
            raw, self._buf = self._buf[: i + 2], self._buf[i + 2:]
            out.append(self._parse(raw))
        return out

    def flush(self) -> list[tuple[bytes, str | None]]:
        rest, self._buf = self._buf, b""
        return [self._parse(rest)] if rest.strip() else []

    @staticmethod
    def _parse(raw: bytes) -> tuple[bytes, str | None]:
        lines = [ln[5:].removeprefix(" ") for ln in raw.decode("utf-8", errors="replace").split("\n")
                 if ln.startswith("data:")]
        return raw, "\n".join(lines) if lines else None


def old_json(data: str | None) -> dict[str, Any] | None:
    if data is None or data == "[DONE]":
        return None
    try:
        obj = json.loads(data)
    except json.JSONDecodeError:
        return None
    return obj if isinstance(obj, dict) else None


def chunk(i: int, delta: dict[str, Any], **kw: Any) -> bytes:
    body = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta}], **kw}
    return b"data: " + json.dumps(body, ensure_ascii=False).encode() + b"\n\n"


USAGE = {"prompt_tokens": 9000, "completion_tokens": 16, "total_tokens": 9016,
         "prompt_tokens_details": {"cached_tokens": 8992}}
MADE = [
    # vLLM with tool calls, continuous usage on content chunks, a usage-only chunk and [DONE]
    chunk(0, {"role": "assistant", "content": ""}) + chunk(1, {"content": "héllo ☃"}, usage=USAGE)
    + chunk(2, {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                "function": {"name": "read", "arguments": ""}}]})
    + chunk(3, {"tool_calls": [{"index": 0, "function": {"arguments": "{\"path\": \"a\"}"}}]})
    + b'data: {"id":"chatcmpl-1","choices":[],"usage":' + json.dumps(USAGE).encode() + b"}\n\ndata: [DONE]\n\n",
    # SGLang-style CRLF, comments, an event field, a multi-line data, no space after the colon, a NaN
    b": ping\r\n\r\ndata:{\"choices\":[{\"index\":0,\"delta\":{\"content\":\"z\"}}]}\r\n\r\n"
    b"event: message\r\ndata:{\"choices\":[{\"index\":0,\"delta\":{\"content\":\"a\"}}]}\r\n\r\n"
    b'data: {"choices":[{"index":0,\r\ndata: "delta":{"content":"b"}}]}\r\n\r\n'
    b'data: {"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":NaN}}\r\n\r\n'
    b"data: not json\r\n\r\ndata: [1, 2]\r\n\r\ndata: {\"x\": \"\xff\"}\r\n\r\ndata: [DONE]\r\n\r\n",
    # a stream cut short: the last event has no blank line
    chunk(0, {"content": "x"}) + b'data: {"choices":[{"index":0,"delta":{"content":"y"}}]}',
]
STREAMS = [p.read_bytes() for p in sorted(DATA.glob("*.txt"))] + MADE


def events(splitter: Any, pieces: list[bytes]) -> list[Any]:
    out: list[Any] = [ev for p in pieces for ev in splitter.feed(p)]
    return out + list(splitter.flush())


@pytest.mark.parametrize("stream", STREAMS)
def test_events_are_what_the_text_splitter_gave(stream: bytes) -> None:
    old = events(OldSplitter(), [stream])
    new = events(SseSplitter(), [stream])
    assert [(e.raw, e.data) for e in new] == old
    assert [e.json() for e in new] == [old_json(d) for _, d in old]
    got = [Usage.parse(j.get("usage")) for j in (e.json() for e in new) if j is not None]
    want = [Usage.parse(j.get("usage")) for j in (old_json(d) for _, d in old) if j is not None]
    assert got == want
    assert any(u is not None for u in got) or stream in MADE[1:]  # the usage the accounting reads


@pytest.mark.parametrize("stream", STREAMS)
def test_any_chunking_gives_the_same_events(stream: bytes) -> None:
    whole = [(e.raw, e.payload) for e in events(SseSplitter(), [stream])]
    rng = random.Random(len(stream))
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(stream)), min(len(stream) - 1, rng.randrange(1, 40))))
        pieces = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True)]
        assert [(e.raw, e.payload) for e in events(SseSplitter(), pieces)] == whole
    one_byte = [stream[i:i + 1] for i in range(len(stream))]
    assert [(e.raw, e.payload) for e in events(SseSplitter(), one_byte)] == whole
