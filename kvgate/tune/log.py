"""A gateway's request log (``gateway/requestlog.py``) read back as sessions for the session fleet.

Each conversation becomes a ``LogSession``: its completed requests in arrival order, each with its
prompt as block hashes (rebuilt from the previous prompt's and the new ones the line carries), its
output length, the tools its reply called, and the wait before it (its arrival minus the previous
request's end: a tool's run time or the user's think time). The blocks a reply adds to the engine's
cache are known from the next prompt: those it shares with the conversation's cached chain beyond the
previous prompt. Requests that did not complete (cancelled, failed) are counted but not replayed.
"""

from __future__ import annotations

import base64
import hashlib
import itertools
import json
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvgate.router.hashing import BlockHash
from kvgate.sim.sessiontypes import Prefix, Request


class LogError(ValueError):
    """Not a kvgate request log, or one this version cannot read."""


def _blocks(b64: str) -> list[BlockHash]:
    raw = base64.b64decode(b64) if b64 else b""
    # The fleet keys its index with the low 64 bits of a block hash (KV events' form): keep them there.
    return [BlockHash(bytes(24) + raw[i:i + 8]) for i in range(0, len(raw) - 7, 8)]


def _filler(key: str, n: int) -> list[BlockHash]:
    """Blocks of a prompt whose start the log does not hold (it began mid-conversation): unique."""
    return [BlockHash(hashlib.blake2b(f"{key}/{i}".encode(), digest_size=32).digest()) for i in range(n)]


@dataclass(frozen=True, slots=True)
class Entry:
    t: float
    end: float
    conv: str
    tenant: str
    model: str
    user_turn: bool
    prompt: int
    block_size: int
    common: int
    k: int
    new: list[BlockHash]
    tools: tuple[str, ...]
    outcome: str
    usage: tuple[int, int, int] | None
    ttft: float | None
    worker: str

    @classmethod
    def parse(cls, d: dict[str, Any]) -> Entry:
        u = d.get("usage")
        return cls(float(d["t"]), float(d["end"]), str(d["conv"]), str(d.get("tenant") or ""), str(d["model"]),
                   bool(d.get("user_turn")), int(d["prompt"]), int(d.get("bs") or 0), int(d.get("c") or 0),
                   int(d.get("k") or 0), _blocks(str(d.get("h") or "")), tuple(d.get("tools") or ()),
                   str(d.get("outcome") or "done"), None if u is None else (int(u[0]), int(u[1]), int(u[2])),
                   None if d.get("ttft") is None else float(d["ttft"]), str(d.get("worker") or ""))


@dataclass(slots=True)
class RequestLogData:
    header: dict[str, Any]
    entries: list[Entry]
    skipped: Counter[str] = field(default_factory=Counter)
    """Lines not replayed, by why (outcome, other model)."""


def read_logs(paths: Iterable[Path]) -> RequestLogData:
    """The lines of one or more log files (a log and its rotated backups, in any order)."""
    header: dict[str, Any] | None = None
    entries: list[Entry] = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    d = json.loads(line)
                except ValueError as exc:
                    raise LogError(f"{path}:{n}: not JSON ({exc})") from None
                if "kvgate_request_log" in d:
                    if d["kvgate_request_log"] != 1:
                        raise LogError(f"{path}: request log version {d['kvgate_request_log']} (this kvgate reads 1)")
                    header = header or d
                    continue
                try:
                    entries.append(Entry.parse(d))
                except (KeyError, TypeError, ValueError) as exc:
                    raise LogError(f"{path}:{n}: not a request line ({exc!r})") from None
    if header is None:
        raise LogError("no kvgate request log header found (is this a request log?)")
    entries.sort(key=lambda e: (e.t, e.conv))
    return RequestLogData(header, entries)


@dataclass(slots=True)
class _Turn:
    e: Entry
    hashes: list[BlockHash]
    output_hashes: list[BlockHash] = field(default_factory=list)


class LogSession:
    """One conversation of the log as a session source (``sim/sessiontypes.SessionSource``)."""

    def __init__(self, conv: str, entries: Sequence[Entry], t0: float) -> None:
        self._id, self._tenant = conv, entries[0].tenant
        self._t0 = t0
        turns: list[_Turn] = []
        for e in entries:
            prev = turns[-1].hashes if turns else []
            head = prev[:e.k] if len(prev) >= e.k else [*prev, *_filler(f"{conv}@{e.t}", e.k - len(prev))]
            turns.append(_Turn(e, [*head, *e.new]))
        for a, b in itertools.pairwise(turns):
            nb = len(a.hashes)
            if b.e.common > nb:  # the reply's blocks the next prompt found cached
                a.output_hashes = b.hashes[nb:b.e.common]
        self.turns = turns

    @property
    def id(self) -> str:
        return self._id

    @property
    def tenant(self) -> str:
        return self._tenant

    @property
    def start_s(self) -> float:
        return self.turns[0].e.t - self._t0

    @property
    def heavy(self) -> bool:
        return False

    def rounds(self) -> int:
        return len(self.turns)

    def wait_s(self, i: int) -> float:
        return max(0.0, self.turns[i].e.t - self.turns[i - 1].e.end) if i > 0 else 0.0

    def kind(self, i: int) -> str:
        return "user" if self.turns[i].e.user_turn else "tool"

    def tools(self, i: int) -> tuple[str, ...]:
        return self.turns[i].e.tools

    def request(self, i: int, chain: list[int]) -> Request:
        t = self.turns[i]
        bs = max(1, t.e.block_size)
        completion = t.e.usage[2] if t.e.usage is not None else 1
        return Request([0] * t.e.prompt, [0] * max(1, completion), t.hashes, min(t.e.prompt, t.e.common * bs),
                       t.output_hashes)

    def next_prefix(self, i: int) -> Prefix:
        """The next request's prompt without its last block: its new user message is short, and the
        log does not say where it starts (an approximation of the canonical prefix)."""
        if i + 1 >= len(self.turns):
            return Prefix([], [])
        nxt = self.turns[i + 1]
        hashes = nxt.hashes[:-1]
        return Prefix([0] * (len(hashes) * max(1, nxt.e.block_size)), hashes)


def sessions(data: RequestLogData, model: str | None = None) -> tuple[str, list[LogSession]]:
    """The log's conversations of ``model`` (default: the model most requests went to) as sessions;
    lines not replayed are counted in ``data.skipped``."""
    if not data.entries:
        raise LogError("the log holds no requests")
    counts = Counter(e.model for e in data.entries)
    model = model or counts.most_common(1)[0][0]
    by_conv: dict[str, list[Entry]] = {}
    for e in data.entries:
        if e.model != model:
            data.skipped["other_model"] += 1
        elif e.outcome != "done" or e.usage is None:
            data.skipped[e.outcome if e.outcome != "done" else "no_usage"] += 1
        else:
            by_conv.setdefault(e.conv, []).append(e)
    if not by_conv:
        raise LogError(f"no completed request of model {model!r} in the log")
    t0 = min(es[0].t for es in by_conv.values())
    return model, [LogSession(c, es, t0) for c, es in by_conv.items()]
