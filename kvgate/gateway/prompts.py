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


@dataclass(slots=True)
class _Chain:
    """What kvgate keeps of a conversation's last prompt, so the next one is tokenized and hashed only
    from where it differs. One record per conversation, one LRU bound."""

    tokens: list[int]
    hashes: list[BlockHash]
    ints: list[int]
    """The hashes in event form, so a turn converts only its new blocks."""
    salt: str | None = None
    text: str | None = None
    """The rendered chat the tokens came from (None when they did not come from local rendering)."""
    ends: list[int] | None = None
    """Character offset in ``text`` where each token ends."""


@dataclass(slots=True)
class _Tokens:
    tokens: list[int] | None
    source: Source
    same_prefix: int | None = None
    """Leading tokens proven equal to the conversation's previous prompt (saves a compare)."""
    text: str | None = None
    ends: list[int] | None = None


class PromptBuilder:
    def __init__(self, tokenizers: Mapping[str, ChatTokenizer], hashers: Mapping[str, VllmHasher],
                 worker_tokenize: WorkerTokenize, max_conversations: int = 10_000) -> None:
        self._tok = dict(tokenizers)
        self._hashers = dict(hashers)
        self._worker_tokenize = worker_tokenize
        self._max = max_conversations
        self._chains: OrderedDict[str, _Chain] = OrderedDict()
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
        prev = self._chains.get(conversation)
        got = await self._tokens(model, endpoint, body, prev)
        hasher = self._hashers.get(model)
        if got.tokens is None or hasher is None:
            return Prompt(_estimate(body), (), "estimate")
        salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
        chain, reused = self._extend(prev, got.tokens, hasher, salt, got.same_prefix)
        chain.text, chain.ends = got.text, got.ends
        self._remember(conversation, chain)
        return Prompt(len(got.tokens), tuple(chain.ints), got.source, reused, tuple(got.tokens))

    async def _tokens(self, model: str, endpoint: str, body: Mapping[str, Any], prev: _Chain | None) -> _Tokens:
        if endpoint == "completions" and isinstance(body.get("prompt"), list) and body["prompt"] \
                and all(isinstance(t, int) for t in body["prompt"]):
            return _Tokens(list(body["prompt"]), "local")
        tok = self._tok.get(model)
        if tok is not None and self.mode.get(model) == "local":
            try:
                if endpoint == "chat":
                    kwargs = body.get("chat_template_kwargs")
                    text = tok.render_chat(body["messages"], body.get("tools"), True,
                                           kwargs if isinstance(kwargs, dict) else None)
                    tokens, same, ends = self._encode_incremental(tok, prev, text)
                    return _Tokens(tokens, "local", same, text, ends)
                if isinstance(body.get("prompt"), str):
                    prompt = body["prompt"]
                    if len(prompt) > 4096:
                        # tokenizers releases the GIL: a long prompt is encoded beside the event loop.
                        return _Tokens(await asyncio.to_thread(tok.encode, prompt, True), "local")
                    return _Tokens(tok.encode(prompt, add_special_tokens=True), "local")
            except (TemplateError, TypeError, ValueError, KeyError) as exc:
                log.info("local tokenization failed (%s); asking a worker", exc)
        req = tokenize_body(endpoint, body)
        if req is None:
            return _Tokens(None, "estimate")
        got = await self._worker_tokenize(model, req)
        return _Tokens(got, "worker") if got is not None else _Tokens(None, "estimate")

    def _encode_incremental(self, tok: ChatTokenizer, prev: _Chain | None, text: str
                            ) -> tuple[list[int], int | None, list[int]]:
        """Tokenize ``text``, re-using the previous prompt's tokens up to the last special token before
        the first changed character: a turn costs its new text, not its whole history.
        Returns (tokens, how many leading tokens were re-used or None, token end offsets)."""
        if prev is not None and prev.text is not None and prev.ends is not None:
            split = tok.last_safe_split(text, common_prefix(prev.text, text))
            k = bisect.bisect_right(prev.ends, split)
            if split > 0 and k > 0 and prev.ends[k - 1] == split:
                ids, ends = tok.encode_with_ends(text[split:])
                self.retokenized_chars += len(text) - split
                return prev.tokens[:k] + ids, k, prev.ends[:k] + [split + e for e in ends]
        tokens, ends = tok.encode_with_ends(text)
        self.retokenized_chars += len(text)
        return tokens, None, ends

    def _extend(self, prev: _Chain | None, tokens: list[int], hasher: VllmHasher, salt: str | None,
                same_prefix: int | None) -> tuple[_Chain, int]:
        """The new prompt's chain, hashing only blocks past its common prefix with the previous one."""
        bs = hasher.block_size
        n_blocks = len(tokens) // bs
        keep = 0
        if prev is not None and prev.salt == salt and prev.hashes:
            common = same_prefix if same_prefix is not None else common_prefix(prev.tokens, tokens)
            keep = min(common // bs, len(prev.hashes), n_blocks)
        base = prev.hashes[:keep] if prev is not None and keep else []
        new = hasher.block_hashes(tokens[keep * bs : n_blocks * bs], parent=base[-1] if base else None,
                                  cache_salt=salt, start_block=keep)
        ints = (prev.ints[:keep] if prev is not None and keep else []) + [event_int(h) for h in new]
        return _Chain(tokens, base + new, ints, salt), keep

    def _remember(self, key: str, chain: _Chain) -> None:
        if not self._max:
            return
        self._chains[key] = chain
        self._chains.move_to_end(key)
        while len(self._chains) > self._max:
            self._chains.popitem(last=False)

    def _render_history(self, model: str, messages: list[dict[str, Any]], tools: Any
                        ) -> tuple[ChatTokenizer, str] | None:
        """``messages`` rendered as history (no generation prompt) with the local tokenizer, if any."""
        tok = self._tok.get(model)
        if tok is None or self.mode.get(model) != "local":
            return None
        try:
            return tok, tok.render_chat(messages, tools, add_generation_prompt=False)
        except (TemplateError, TypeError, ValueError, KeyError):
            return None

    def render_tokens(self, model: str, messages: list[dict[str, Any]], tools: Any, key: str) -> list[int] | None:
        """Tokens of ``messages`` rendered as history, incrementally under ``key``; None without a local
        tokenizer. The trailing newline the template writes after the last message is not something the
        engine generated, so it is left out."""
        rendered = self._render_history(model, messages, tools)
        if rendered is None:
            return None
        tok, text = rendered
        text = text.rstrip("\n")
        tokens, _, ends = self._encode_incremental(tok, self._chains.get(key), text)
        self._remember(key, _Chain(tokens, [], [], None, text, ends))
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
        rendered = self._render_history(model, messages, tools)
        if rendered is None:
            return None
        tok, text = rendered
        cut = text.find(marker)
        return None if cut < 0 else tok.encode(text[: tok.last_safe_split(text, cut)])


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
