"""The request log: one JSON line per request that reached a worker, for ``kvgate tune`` (what-if replay).

Opt-in (``request_log``: a file path). Content-free: times, tenant, conversation, model, token counts,
the prompt's block hashes (re-hashed with a secret key, so a log cannot confirm a guessed prompt), the
tools the reply called, the outcome, the usage, and where it was routed and why — never a message. A
prompt's hashes are logged from where it stops sharing blocks with the conversation's previous prompt,
so a long conversation costs a few hashes per request, not its whole history.

The event loop only puts a small entry (references to what the request already holds) on a queue
bounded in bytes; a thread keys the hashes, encodes the line and writes it, and rotates the file at
``request_log_max_bytes`` keeping ``request_log_backups`` old files (``PATH.1`` newest). Every file starts
with a header: the gateway's routing and session settings and its workers, as ``kvgate tune`` replays
them. A full queue drops entries (counted) rather than slow requests down.

Line format (``kvgate/tune/log.py`` reads it): ``t`` arrival and ``end`` wall times; ``conv``, ``tenant``,
``model``, ``ep`` (chat, completions), ``user_turn``, ``stream``; ``prompt`` tokens as routed and their
``tok`` source; ``bs`` the block size of the hashes, ``c`` leading blocks equal to the conversation's
cached chain (its previous prompt and reply), ``k`` the index of the first hash in ``h`` (blocks before it
are the previous prompt's), ``h`` base64 of 8-byte keyed hashes; ``tools``; ``outcome`` (done, cancelled,
failed); ``usage`` [prompt, cached, completion]; ``ttft`` s; ``worker``, ``reason``, ``expected`` cached
tokens; ``lost``/``cause`` reusable history lost and why; ``waited`` the tool wait that ended.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import queue
import secrets
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from kvgate.gateway.exchange import Exchange

log = logging.getLogger(__name__)

VERSION = 1
MAX_QUEUED_BYTES = 32 << 20
"""Entries waiting for the writer, in approximate bytes: past it, entries are dropped."""


def entry(ex: Exchange, outcome: str, now: float) -> tuple[dict[str, Any], tuple[int, ...]]:
    """A request's log line before encoding, and the prompt hashes it logs: cheap, on the event loop."""
    p, d, u = ex.prepared, ex.decision, ex.usage
    hashes: tuple[int, ...] = ()
    bs = 0
    if p.prompt.hashes:
        spec = min(p.prompt.hashes, key=lambda s: (s.block_size, repr(s)))
        hashes, bs = p.prompt.hashes[spec], spec.block_size
    loss = p.turn.loss if p.turn is not None else None
    conv = p.conv
    common = 0
    if loss is not None and bs and conv is not None and conv.chain is not None:
        same = loss.diverged_at if loss.diverged_at is not None else min(len(conv.chain.tokens), p.prompt.length)
        common = min(same // bs, len(hashes))
    prev = conv.turns[-1].prompt_tokens // bs if bs and conv is not None and conv.turns else 0
    k = min(common, prev)
    waited = p.arrival.state.pending_wait
    line = {
        "t": round(p.arrived_at, 6), "end": round(now, 6), "conv": p.ident.conversation_id, "tenant": p.ident.tenant,
        "model": p.model, "ep": p.endpoint, "user_turn": p.user_turn, "stream": p.stream, "prompt": p.prompt.length,
        "tok": p.prompt.source, "bs": bs, "c": common, "k": k, "tools": list(ex.reply.tool_names()),
        "outcome": outcome, "usage": None if u is None else [u.prompt_tokens, u.cached_tokens, u.completion_tokens],
        "ttft": None if ex.ttft_s is None else round(ex.ttft_s, 6), "worker": d.worker, "reason": d.reason,
        "expected": d.expected_cached_tokens, "lost": loss.lost if loss is not None else 0,
        "cause": loss.cause if loss is not None else None,
        "waited": None if waited is None else round(waited.waited_s, 6)}
    return line, hashes[k:]


class RequestLog:
    """Off unless given a path: ``write`` then does nothing."""

    def __init__(self, path: str | None = None, max_bytes: int = 64 << 20, backups: int = 3,
                 key: bytes | None = None) -> None:
        self.path = Path(path) if path else None
        self.max_bytes = max_bytes
        self.backups = backups
        self._key = key or secrets.token_bytes(16)
        self._q: queue.Queue[tuple[dict[str, Any], tuple[int, ...]] | None] = queue.Queue()
        self._queued = 0
        self._lock = threading.Lock()
        self.dropped = 0
        self.written = 0
        self._header: dict[str, Any] = {}
        self._thread: threading.Thread | None = None

    @property
    def enabled(self) -> bool:
        return self.path is not None

    def start(self, header: Mapping[str, Any]) -> None:
        """Start writing; ``header`` (settings and workers) opens every file."""
        if self.path is None or self._thread is not None:
            return
        self._header = {"kvgate_request_log": VERSION, "key_id": hashlib.blake2b(self._key, digest_size=4).hexdigest(),
                        **header}
        self._thread = threading.Thread(target=self._run, name="kvgate-request-log", daemon=True)
        self._thread.start()

    def write(self, ex: Exchange, outcome: str) -> None:
        if self._thread is None:
            return
        line, hashes = entry(ex, outcome, time.time())
        size = 512 + 8 * len(hashes)
        with self._lock:
            if self._queued + size > MAX_QUEUED_BYTES:
                self.dropped += 1
                return
            self._queued += size
        self._q.put((line, hashes))

    def close(self) -> None:
        if self._thread is not None:
            self._q.put(None)
            self._thread.join(timeout=10)
            self._thread = None

    # -- the writer thread ---------------------------------------------------------------------------
    def _key_hashes(self, hashes: tuple[int, ...]) -> str:
        key = self._key
        raw = b"".join(hashlib.blake2b(h.to_bytes(8, "big"), digest_size=8, key=key).digest() for h in hashes)
        return base64.b64encode(raw).decode()

    def _open(self) -> TextIO:
        assert self.path is not None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        f = open(self.path, "a", encoding="utf-8")  # the writer thread owns it until _rotate or the end
        if f.tell() == 0:
            f.write(json.dumps({**self._header, "opened": time.time()}) + "\n")
        return f

    def _rotate(self, f: TextIO) -> TextIO:
        assert self.path is not None
        f.close()
        for i in range(self.backups, 0, -1):
            src = self.path if i == 1 else self.path.with_name(f"{self.path.name}.{i - 1}")
            if src.exists():
                os.replace(src, self.path.with_name(f"{self.path.name}.{i}"))
        if self.backups == 0:
            self.path.unlink(missing_ok=True)
        return self._open()

    def _run(self) -> None:
        try:
            f = self._open()
        except OSError as exc:
            log.error("request log %s: %s; not logging requests", self.path, exc)
            return
        size = f.tell()
        try:
            while (item := self._q.get()) is not None:
                line, hashes = item
                with self._lock:
                    self._queued -= 512 + 8 * len(hashes)
                line["h"] = self._key_hashes(hashes)
                text = json.dumps(line, separators=(",", ":")) + "\n"
                f.write(text)
                size += len(text)
                self.written += 1
                if size >= self.max_bytes:
                    f = self._rotate(f)
                    size = f.tell()
                elif self._q.empty():
                    f.flush()
        except OSError as exc:
            log.error("request log %s: %s; not logging requests any more", self.path, exc)
        finally:
            f.close()
