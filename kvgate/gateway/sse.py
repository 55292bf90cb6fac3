"""Server-sent events, split as they arrive so each event is forwarded the moment it is complete.

Kept as bytes: an event is found by its blank line and its ``data:`` lines are sliced out of it, never
decoded to text; its JSON is parsed (orjson) only when the relay reads it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import orjson

_DONE = b"[DONE]"


@dataclass(frozen=True, slots=True)
class SseEvent:
    raw: bytes
    """The event's bytes including its terminating blank line, forwarded unchanged."""
    payload: bytes | None
    """The joined ``data:`` lines, or None for comments and other fields."""

    @property
    def data(self) -> str | None:
        return None if self.payload is None else self.payload.decode("utf-8", errors="replace")

    @property
    def done(self) -> bool:
        return self.payload == _DONE

    def json(self) -> dict[str, Any] | None:
        if self.payload is None or self.payload == _DONE:
            return None
        try:
            obj = orjson.loads(self.payload)
        except orjson.JSONDecodeError:
            # What orjson refuses and the stdlib took (NaN, invalid UTF-8 replaced): read as it always was.
            try:
                obj = json.loads(self.payload.decode("utf-8", errors="replace"))
            except (ValueError, RecursionError):
                return None
        return obj if isinstance(obj, dict) else None


class SseSplitter:
    def __init__(self) -> None:
        self._buf = b""

    def feed(self, chunk: bytes) -> list[SseEvent]:
        # A CRLF split across two chunks is joined before it is replaced: the buffer keeps a trailing CR.
        buf = self._buf + chunk
        if b"\r" in buf:
            buf = buf.replace(b"\r\n", b"\n")
        out = []
        start = 0
        while True:
            i = buf.find(b"\n\n", start)
            if i < 0:
                break
            out.append(_parse(buf[start:i + 2]))
            start = i + 2
        self._buf = buf[start:] if start else buf
        return out

    def flush(self) -> list[SseEvent]:
        rest, self._buf = self._buf, b""
        return [_parse(rest)] if rest.strip() else []


def _parse(raw: bytes) -> SseEvent:
    if raw.startswith(b"data:") and raw.find(b"\n", 0, len(raw) - 2) < 0:
        # One data line, what engines send: sliced, not split.
        end = len(raw) - 2 if raw.endswith(b"\n\n") else len(raw.rstrip(b"\n"))
        return SseEvent(raw, raw[6 if raw.startswith(b"data: ") else 5:end])
    data_lines = [line[5:].removeprefix(b" ") for line in raw.split(b"\n") if line.startswith(b"data:")]
    return SseEvent(raw, b"\n".join(data_lines) if data_lines else None)


def error_event(message: str, code: int = 502) -> bytes:
    body = {"error": {"message": message, "type": "upstream_error", "param": None, "code": code}}
    return b"data: " + json.dumps(body).encode() + b"\n\n"
