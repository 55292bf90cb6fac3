"""A request's prompt as the engine will see it: tokens and block hashes, computed once per request.

Tokens come from the model's local tokenizer (rendered with its chat template exactly as vLLM renders
it), or — for a model without one, or whose local tokenizer failed the parity probe — from a worker's
``/tokenize``. If neither works the request is still served: routing falls back to an estimated
length and no prefix information (never a rejection for kvgate's own reasons).

Hashing is incremental per conversation: the previous prompt's tokens and hashes are kept, the new
prompt is compared with them, and only blocks past the first difference are hashed, so a long
history costs no more per turn than a short one.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from kvgate.router.hashing import BlockHash, VllmHasher, event_int
from kvgate.tokens.template import TemplateError
from kvgate.tokens.tokenizer import ChatTokenizer

log = logging.getLogger(__name__)

Source = Literal["local", "worker", "estimate"]
WorkerTokenize = Callable[[str, dict[str, Any]], Awaitable[list[int] | None]]
"""(model, /tokenize body) -> token ids, or None when no worker could tokenize."""

PROBE: list[dict[str, Any]] = [
    {"role": "system", "content": "You are a careful assistant. Ünïcode ✓"},
    {"role": "user", "content": "Find the weather in Paris."},
    {"role": "assistant", "content": "", "reasoning": "call the tool",
     "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                                 "arguments": "{\"city\":\"Paris\"}"}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
]
PROBE_TOOLS: list[dict[str, Any]] = [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                                 "parameters": {"type": "object"}}}]


@dataclass(frozen=True, slots=True)
class Prompt:
    length: int
    hashes: tuple[int, ...]
    """Event-form (64-bit) hashes of the prompt's full blocks; empty when the tokens are unknown."""
    source: Source
    reused_blocks: int = 0
    tokens: tuple[int, ...] | None = None
    """Blocks whose hashes came from the conversation's previous prompt (not recomputed)."""


def tokenize_body(endpoint: str, body: Mapping[str, Any]) -> dict[str, Any] | None:
    """The /tokenize request equivalent to a chat or completion request (None if there is none)."""
    if endpoint == "chat":
        out: dict[str, Any] = {"model": body["model"], "messages": body["messages"], "add_generation_prompt": True}
        for k in ("tools", "chat_template_kwargs"):
            if body.get(k) is not None:
                out[k] = body[k]
        return out
    if isinstance(body.get("prompt"), str):
        return {"model": body["model"], "prompt": body["prompt"]}
    return None


class PromptBuilder:
    def __init__(self, tokenizers: Mapping[str, ChatTokenizer], hashers: Mapping[str, VllmHasher],
                 worker_tokenize: WorkerTokenize, max_conversations: int = 10_000) -> None:
        self._tok = dict(tokenizers)
        self._hashers = dict(hashers)
        self._worker_tokenize = worker_tokenize
        self._max = max_conversations
        self._chains: OrderedDict[str, tuple[list[int], list[BlockHash], str | None]] = OrderedDict()
        self._ints: dict[str, list[int]] = {}
        """The event-form ints of each chain's hashes, kept so a turn converts only its new blocks."""
        self._texts: OrderedDict[str, tuple[str, list[int]]] = OrderedDict()
        """Per conversation: the last rendered prompt and its token end offsets (local tokenizer only)."""
        self.retokenized_chars = 0
        self.mode: dict[str, Source] = {m: ("local" if m in self._tok else "worker") for m in self._hashers}
        self.parity_failures: dict[str, int] = {}

    # -- start-up and worker joins -------------------------------------------------------------------
    async def check_parity(self, model: str) -> bool | None:
        """Compare the local tokenizer with a worker's /tokenize on a probe conversation. A mismatch
        switches the model to worker tokenization (what kvgate forwards must be what it hashed).
        None: no local tokenizer, or no worker answered."""
        tok = self._tok.get(model)
        if tok is None:
            return None
        want = await self._worker_tokenize(model, {"model": model, "messages": PROBE, "tools": PROBE_TOOLS,
                                                   "add_generation_prompt": True})
        if want is None:
            return None
        got = tok.encode_chat(PROBE, PROBE_TOOLS)
        if got == want:
            if self.mode.get(model) != "local":
                log.info("tokenizer parity restored for %s", model)
            self.mode[model] = "local"
            return True
        self.parity_failures[model] = self.parity_failures.get(model, 0) + 1
        first = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
        log.error("TOKENIZER MISMATCH for model %s: local and worker tokens differ at position %d (local %d "
                  "tokens, worker %d); routing will use the worker's /tokenize for this model", model, first,
                  len(got), len(want))
        self.mode[model] = "worker"
        return False

    # -- per request -------------------------------------------------------------------------------
    async def prepare(self, model: str, endpoint: str, body: Mapping[str, Any], conversation: str) -> Prompt:
        tokens, source, same, rendered = await self._tokens(model, endpoint, body, conversation)
        if not rendered:
            # These tokens did not come from a rendered chat: the stored text no longer matches them.
            self._texts.pop(conversation, None)
        hasher = self._hashers.get(model)
        if tokens is None or hasher is None:
            return Prompt(_estimate(body), (), "estimate")
        salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
        hashes, reused = self._hash(conversation, tokens, hasher, salt, same)
        ints = self._ints.get(conversation, [])[:reused] + [event_int(h) for h in hashes[reused:]]
        if self._max:
            self._ints[conversation] = ints
            if len(self._ints) > self._max:
                self._ints = {k: v for k, v in self._ints.items() if k in self._chains}
        return Prompt(len(tokens), tuple(ints), source, reused, tuple(tokens))

    async def _tokens(self, model: str, endpoint: str, body: Mapping[str, Any], conversation: str = ""
                      ) -> tuple[list[int] | None, Source, int | None, bool]:
        """(tokens, source, tokens proven equal to the conversation's previous prompt, rendered chat?)"""
        if endpoint == "completions" and isinstance(body.get("prompt"), list) and body["prompt"] \
                and all(isinstance(t, int) for t in body["prompt"]):
            return list(body["prompt"]), "local", None, False
        tok = self._tok.get(model)
        if tok is not None and self.mode.get(model) == "local":
            try:
                if endpoint == "chat":
                    kwargs = body.get("chat_template_kwargs")
                    text = tok.render_chat(body["messages"], body.get("tools"), True,
                                           kwargs if isinstance(kwargs, dict) else None)
                    tokens, same = self._encode_incremental(tok, conversation, text)
                    return tokens, "local", same, True
                if isinstance(body.get("prompt"), str):
                    prompt = body["prompt"]
                    if len(prompt) > 4096:
                        # tokenizers releases the GIL: a long prompt is encoded beside the event loop.
                        return await asyncio.to_thread(tok.encode, prompt, True), "local", None, False
                    return tok.encode(prompt, add_special_tokens=True), "local", None, False
            except (TemplateError, TypeError, ValueError, KeyError) as exc:
                log.info("local tokenization failed (%s); asking a worker", exc)
        req = tokenize_body(endpoint, body)
        if req is None:
            return None, "estimate", None, False
        got = await self._worker_tokenize(model, req)
        return (got, "worker", None, False) if got is not None else (None, "estimate", None, False)

    def _encode_incremental(self, tok: ChatTokenizer, conversation: str, text: str) -> tuple[list[int], int | None]:
        """Tokenize ``text``, re-using the conversation's previous tokens up to the last special token
        before the first changed character: a turn costs its new text, not its whole history."""
        prev = self._texts.get(conversation) if self._max else None
        prev_tokens = self._chains.get(conversation)
        if prev is not None and prev_tokens is not None:
            old_text, old_ends = prev
            split = tok.last_safe_split(text, common_prefix(old_text, text))
            k = bisect.bisect_right(old_ends, split)
            if split > 0 and k > 0 and old_ends[k - 1] == split:
                ids, ends = tok.encode_with_ends(text[split:])
                tokens = prev_tokens[0][:k] + ids
                all_ends = old_ends[:k] + [split + e for e in ends]
                self.retokenized_chars += len(text) - split
                self._remember_text(conversation, text, all_ends)
                return tokens, k
        tokens, ends = tok.encode_with_ends(text)
        self.retokenized_chars += len(text)
        self._remember_text(conversation, text, ends)
        return tokens, None

    def _remember_text(self, conversation: str, text: str, ends: list[int]) -> None:
        if not self._max:
            return
        self._texts[conversation] = (text, ends)
        self._texts.move_to_end(conversation)
        while len(self._texts) > self._max:
            self._texts.popitem(last=False)

    def _hash(self, conversation: str, tokens: list[int], hasher: VllmHasher, salt: str | None,
              same_prefix: int | None = None) -> tuple[list[BlockHash], int]:
        bs = hasher.block_size
        n_blocks = len(tokens) // bs
        prev = self._chains.get(conversation)
        keep = 0
        if prev is not None and prev[2] == salt:
            old_tokens, old_hashes, _ = prev
            common = same_prefix if same_prefix is not None else common_prefix(old_tokens, tokens)
            keep = min(common // bs, len(old_hashes), n_blocks)
        base = prev[1][:keep] if prev is not None and keep else []
        new = hasher.block_hashes(tokens[keep * bs : n_blocks * bs], parent=base[-1] if base else None,
                                  cache_salt=salt, start_block=keep)
        hashes = base + new
        if self._max:
            self._chains[conversation] = (tokens, hashes, salt)
            self._chains.move_to_end(conversation)
            while len(self._chains) > self._max:
                self._chains.popitem(last=False)
        return hashes, keep

    def render_tokens(self, model: str, messages: list[dict[str, Any]], tools: Any, key: str) -> list[int] | None:
        """Tokens of ``messages`` rendered as history (no generation prompt), incrementally under ``key``;
        None without a local tokenizer. The trailing newline the template writes after the last message is
        not something the engine generated, so it is left out."""
        tok = self._tok.get(model)
        if tok is None or self.mode.get(model) != "local":
            return None
        try:
            text = tok.render_chat(messages, tools, add_generation_prompt=False)
        except (TemplateError, TypeError, ValueError, KeyError):
            return None
        tokens, _ = self._encode_incremental(tok, key, text.rstrip("\n"))
        self._chains[key] = (tokens, [], None)
        return tokens

    def truncate_tokens(self, model: str, text: str, n: int) -> str | None:
        """``text`` cut to its first ``n`` tokens of ``model``; None without a local tokenizer."""
        tok = self._tok.get(model)
        if tok is None:
            return None
        ids = tok.encode(text)
        return text if len(ids) <= n else tok.decode(ids[:n])

    def render_prefix(self, model: str, messages: list[dict[str, Any]], tools: Any, marker: str) -> list[int] | None:
        """Tokens of the rendered ``messages`` up to the special token that opens the message holding
        ``marker`` (a placeholder): the prefix any next message will share."""
        tok = self._tok.get(model)
        if tok is None or self.mode.get(model) != "local":
            return None
        try:
            text = tok.render_chat(messages, tools, add_generation_prompt=False)
        except (TemplateError, TypeError, ValueError, KeyError):
            return None
        cut = text.find(marker)
        if cut < 0:
            return None
        return tok.encode(text[: tok.last_safe_split(text, cut)])

    def forget(self, conversation: str) -> None:
        self._ints.pop(conversation, None)
        self._chains.pop(conversation, None)
        self._texts.pop(conversation, None)


def common_prefix(a: Sequence[Any], b: Sequence[Any]) -> int:
    """Length of the common prefix, by bisection on C-speed slice compares (no per-token Python loop).

    Slices only compare equal between sequences of the same type (a list never equals a tuple), so
    token sequences are compared as lists."""
    if type(a) is not type(b) and not (isinstance(a, str) and isinstance(b, str)):
        a, b = list(a), list(b)
    lo, hi = 0, min(len(a), len(b))
    if a[:hi] == b[:hi]:  # the common case: the new prompt extends the old one
        return hi
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _estimate(body: Mapping[str, Any]) -> int:
    """~4 characters a token: only for load estimates when the real tokens are unknown."""
    chars = 0
    for m in body.get("messages") or []:
        c = m.get("content") if isinstance(m, dict) else None
        chars += len(c) if isinstance(c, str) else sum(len(str(p)) for p in c or [])
    p = body.get("prompt")
    chars += len(p) if isinstance(p, str) else 0
    return max(1, chars // 4)
