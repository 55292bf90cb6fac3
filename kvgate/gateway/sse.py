"""Server-sent events, split as they arrive so each event is forwarded the moment it is complete."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class SseEvent:
    raw: bytes
    """The event's bytes including its terminating blank line, forwarded unchanged."""
    data: str | None
    """The joined ``data:`` lines, or None for comments and other fields."""

    def json(self) -> dict[str, Any] | None:
        if self.data is None or self.data == "[DONE]":
            return None
        try:
            obj = json.loads(self.data)
        except json.JSONDecodeError:
            return None
        return obj if isinstance(obj, dict) else None


class SseSplitter:
    def __init__(self) -> None:
        self._buf = b""

    def feed(self, chunk: bytes) -> list[SseEvent]:
        self._buf += chunk.replace(b"\r\n", b"\n")
        out = []
        while True:
            i = self._buf.find(b"\n\n")
            if i < 0:
                break
            raw, self._buf = self._buf[: i + 2], self._buf[i + 2 :]
            out.append(_parse(raw))
        return out

    def flush(self) -> list[SseEvent]:
        rest, self._buf = self._buf, b""
        return [_parse(rest)] if rest.strip() else []


def _parse(raw: bytes) -> SseEvent:
    data_lines = []
    for line in raw.decode("utf-8", errors="replace").split("\n"):
        if line.startswith("data:"):
            data_lines.append(line[5:].removeprefix(" "))
    return SseEvent(raw, "\n".join(data_lines) if data_lines else None)


def error_event(message: str, code: int = 502) -> bytes:
    body = {"error": {"message": message, "type": "upstream_error", "param": None, "code": code}}
    return b"data: " + json.dumps(body).encode() + b"\n\n"
