"""A request's prompt as the engine will see it: tokens and block hashes, computed once per request.

Tokens come from the model's local tokenizer (rendered with its chat template exactly as vLLM renders
it), or — for a model without one, or whose local tokenizer failed the parity probe — from a worker's
``/tokenize``. If neither works the request is still served: routing falls back to an estimated
length and no prefix information (never a rejection for kvgate's own reasons).

Both are incremental per conversation, against the conversation's chain (its last completed turn as
the worker cached it, kept in its record): the new prompt is tokenized only from the last special
token before its first changed character, and only blocks past the first differing token are hashed,
so a long history costs no more per turn than a short one; a long text without a chain is tokenized
beside the event loop, and only as far as some worker holds its blocks (``chaintok.py``): routing
needs no more. The builder itself keeps no per-conversation
state: the chain comes in with the request and a new one goes out with the completed turn. Workers of
one model need not hash alike (block size, algorithm, seed): a prompt is hashed once per distinct
``HashSpec`` among its model's workers.
"""

from __future__ import annotations

import asyncio
import logging
from array import array
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from kvgate.gateway.chaintok import ChainTokenizer
from kvgate.gateway.inputlimits import text_chars
from kvgate.router.hashing import BlockHash, BlockHasher, HashSpec, make_hasher
from kvgate.session.conversation import Chain
from kvgate.tokens.template import TemplateError
from kvgate.tokens.tokenizer import ChatTokenizer

log = logging.getLogger(__name__)

Source = Literal["local", "worker", "estimate"]
WorkerTokenize = Callable[[str, dict[str, Any]], Awaitable[list[int] | None]]
"""(model, /tokenize body) -> token ids, or None when no worker could tokenize."""
SpecsOf = Callable[[str], Sequence[HashSpec]]
"""The distinct hash identities of a model's workers (each prompt is hashed once per identity)."""
Held = Callable[[HashSpec, int], bool]
"""Whether some worker of this hash identity holds the block with this id (its cache or in flight)."""

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
    """Tokens of the prompt (when ``complete`` is False, the tokens so far plus an estimate of the rest)."""
    hashes: Mapping[HashSpec, tuple[int, ...]]
    """Per hash identity, the event-form (64-bit) hashes of the prompt's full blocks (as far as it was
    tokenized); empty when the tokens are unknown."""
    source: Source
    reused_blocks: int = 0
    """Blocks whose hashes came from the conversation's chain (not recomputed), summed over identities."""
    tokens: array[int] | None = None
    chain: Chain | None = None
    """The prompt as a chain (rendered text, tokens, anchors, hashes) when it was rendered locally: the
    completed turn's chain is tokenized incrementally from it."""
    complete: bool = True
    """False when tokenization stopped where no worker holds the blocks: ``tokens`` is a prefix."""
    text: str | None = None
    """The whole rendered prompt when ``tokens`` is a prefix of it: ``complete`` tokenizes the rest once
    the request is sent."""


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
class _Tokens:
    tokens: array[int] | None
    source: Source
    chain: Chain | None = None
    complete: bool = True
    rest_chars: int = 0
    """Characters of the rendered text not tokenized (``complete`` False)."""
    text: str | None = None


class PromptBuilder:
    def __init__(self, tokenizers: Mapping[str, ChatTokenizer], specs: SpecsOf,
                 worker_tokenize: WorkerTokenize, inline_chars: int = 16_384) -> None:
        self._tok = dict(tokenizers)
        self._inline_chars = inline_chars
        self._chains = {m: ChainTokenizer(t) for m, t in self._tok.items()}
        self._specs = specs
        self._hashers: dict[HashSpec, BlockHasher | None] = {}
        self._worker_tokenize = worker_tokenize
        self.mode: dict[str, Source] = {m: "local" for m in self._tok}
        """Models tokenized locally; any other model (or one that failed the parity probe) by a worker."""
        self.parity_failures: dict[str, int] = {}
        self.deferred = 0
        """Prompts routed on their head, the rest tokenized after sending (``ChainTokenizer.head``)."""

    @property
    def retokenized_chars(self) -> int:
        return sum(c.retokenized_chars for c in self._chains.values())

    def block_size(self, model: str) -> int:
        """The block size losses are counted in: the smallest of the model's workers'."""
        return min((s.block_size for s in self._specs(model)), default=16)

    def _hasher(self, spec: HashSpec) -> BlockHasher | None:
        if spec not in self._hashers:
            try:
                self._hashers[spec] = make_hasher(spec)
            except ValueError as exc:  # the worker hashes in a way kvgate cannot: no prefix knowledge
                log.error("cannot hash for %s: %s", spec, exc)
                self._hashers[spec] = None
        return self._hashers[spec]

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
    async def prepare(self, model: str, endpoint: str, body: Mapping[str, Any], chain: Chain | None,
                      held: Held | None = None, defer: bool = False, token_limit: int | None = None) -> Prompt:
        """The request's prompt, tokenized and hashed incrementally against the conversation's ``chain``.
        ``held``: when given, a long text is tokenized only as far as some worker holds its blocks.
        ``defer`` (with ``held``): a long new text appended to ``chain`` is tokenized only as far as its
        first block, unless some worker holds that block; the result's ``text`` is then set and the caller
        completes the prompt (``complete``) after routing. Not for a prompt that may exceed ``token_limit``:
        that is checked on exact tokens, before sending."""
        salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
        stop = self._stop(model, salt, held) if held else None
        got = await self._tokens(model, endpoint, body, chain, stop, defer, token_limit)
        if got.tokens is None:
            return Prompt(_estimate(body), {}, "estimate")
        work = got.chain or Chain("", got.tokens, array("I"), array("I"))
        out, reused = self._hash_all(model, salt, work)
        length = len(got.tokens)
        if not got.complete and got.rest_chars:
            # The rest at the rate of what was tokenized: load estimates only, the cache match is exact.
            length += round(got.rest_chars * len(got.tokens) / max(1, len(work.text)))
        return Prompt(length, out, got.source, reused, got.tokens, got.chain, got.complete, got.text)

    def complete(self, model: str, prompt: Prompt, salt: str | None) -> Prompt:
        """``prompt`` (its ``text`` tokenized only in part) tokenized and hashed whole, on the calling
        thread; the blocks already hashed carry over."""
        if prompt.text is None or prompt.chain is None:
            return prompt
        chain, _ = self._chains[model].chain_sync(prompt.chain, prompt.text)
        out, reused = self._hash_all(model, salt, chain)
        return Prompt(len(chain.tokens), out, prompt.source, reused, chain.tokens, chain)

    def _hash_all(self, model: str, salt: str | None, chain: Chain) -> tuple[dict[HashSpec, tuple[int, ...]], int]:
        out: dict[HashSpec, tuple[int, ...]] = {}
        reused = 0
        for spec in self._specs(model):
            ints, kept = self._hash(spec, salt, chain)
            if ints is not None:
                out[spec] = tuple(ints)
                reused += kept
        return out, reused

    def _hash(self, spec: HashSpec, salt: str | None, chain: Chain) -> tuple[list[int] | None, int]:
        """The event ids of ``chain``'s full blocks for ``spec``, extending what the chain already holds
        (its hashes are kept in it: the turn's chain and the next request reuse them)."""
        hasher = self._hasher(spec)
        if hasher is None:
            return None, 0
        bs = hasher.block_size
        key = (spec, salt)
        cached = chain.hashes.get(key)
        n_blocks = len(chain.tokens) // bs
        if cached is not None and len(cached[1]) == n_blocks:
            return cached[2], n_blocks  # nothing new (a chain whose hashes were taken whole)
        keep = min(len(cached[1]), n_blocks) if cached is not None else 0
        digests: list[bytes] = cached[1][:keep] if cached is not None else []
        new = hasher.block_hashes(chain.tokens[keep * bs: n_blocks * bs],
                                  parent=BlockHash(digests[-1]) if digests else None, cache_salt=salt,
                                  start_block=keep)
        ints = (cached[2][:keep] if cached is not None else []) + hasher.event_ints(new, cache_salt=salt)
        digests.extend(new)
        chain.hashes[key] = (bs, digests, ints)
        return ints, keep

    def _stop(self, model: str, salt: str | None, held: Held) -> Callable[[Chain], bool]:
        """Stop tokenizing once no worker of any identity holds the last full block so far: hashes are
        chained, so nothing beyond it can be held either and the prefix match is already known."""
        def stop(chain: Chain) -> bool:
            for spec in self._specs(model):
                ints, _ = self._hash(spec, salt, chain)
                if ints and held(spec, ints[-1]):
                    return False
            return True

        return stop

    async def _tokens(self, model: str, endpoint: str, body: Mapping[str, Any], chain: Chain | None,
                      stop: Callable[[Chain], bool] | None, defer: bool = False, token_limit: int | None = None
                      ) -> _Tokens:
        if endpoint == "completions" and isinstance(body.get("prompt"), list) and body["prompt"] \
                and all(isinstance(t, int) for t in body["prompt"]):
            return _Tokens(array("I", body["prompt"]), "local")
        tok = self._tok.get(model)
        if tok is not None and self.mode.get(model) == "local":
            try:
                if endpoint == "chat":
                    kwargs = body.get("chat_template_kwargs")
                    args = (body["messages"], body.get("tools"), True, kwargs if isinstance(kwargs, dict) else None)
                    # Rendering a long conversation (Jinja over every message) takes as long as
                    # tokenizing it: beside the event loop, like the tokenizing.
                    text = tok.render_chat(*args) if _render_size(body) <= self._inline_chars \
                        else await asyncio.to_thread(tok.render_chat, *args)
                    head = self._head(model, chain, text, stop, token_limit) if defer and stop is not None \
                        else None
                    if head is not None:
                        self.deferred += 1
                        return _Tokens(head.tokens, "local", head, False, len(text) - len(head.text), text)
                    new, _, complete = await self._chains[model].chain(chain, text, stop if chain is None else None)
                    return _Tokens(new.tokens, "local", new, complete, len(text) - len(new.text))
                if isinstance(body.get("prompt"), str):
                    prompt = body["prompt"]
                    if len(prompt) > self._inline_chars:
                        # tokenizers releases the GIL: a long prompt is encoded beside the event loop.
                        return _Tokens(array("I", await asyncio.to_thread(tok.encode, prompt, True)), "local")
                    return _Tokens(array("I", tok.encode(prompt, add_special_tokens=True)), "local")
            except (TemplateError, TypeError, ValueError, KeyError) as exc:
                log.info("local tokenization failed (%s); asking a worker", exc)
        req = tokenize_body(endpoint, body)
        if req is None:
            return _Tokens(None, "estimate")
        got = await self._worker_tokenize(model, req)
        return _Tokens(array("I", got), "worker") if got is not None else _Tokens(None, "estimate")

    def _head(self, model: str, chain: Chain | None, text: str, stop: Callable[[Chain], bool],
              token_limit: int | None) -> Chain | None:
        """The head of ``text`` past ``chain`` (``ChainTokenizer.head``) when no worker holds its last block:
        hashes are chained, so none holds anything after it and routing knows all it needs. Not when the
        whole might exceed ``token_limit``: a token is at least one byte, so the head's tokens plus the
        rest's bytes bound it."""
        bs = max((s.block_size for s in self._specs(model)), default=16)
        head = self._chains[model].head(chain, text, bs)
        if head is None or (token_limit is not None
                            and len(head.tokens) + len(text[len(head.text):].encode()) >= token_limit):
            return None
        return head if stop(head) else None

    # -- the completed turn ------------------------------------------------------------------------
    def _render_history(self, model: str, messages: Sequence[Mapping[str, Any]], tools: Any
                        ) -> tuple[ChatTokenizer, str] | None:
        """``messages`` rendered as history (no generation prompt) with the local tokenizer, if any."""
        tok = self._tok.get(model)
        if tok is None or self.mode.get(model) != "local":
            return None
        try:
            return tok, tok.render_chat(messages, tools, add_generation_prompt=False)
        except (TemplateError, TypeError, ValueError, KeyError):
            return None

    def chain_for(self, model: str, messages: Sequence[Mapping[str, Any]], tools: Any, prev: Chain | None
                  ) -> Chain | None:
        """The chain of a completed turn (``messages`` ending with the reply), tokenized incrementally
        from ``prev`` (the prompt just sent; its block hashes carry over for the blocks they share) on the
        calling thread; None without a local tokenizer. The trailing newline the template writes after
        the last message is not something the engine generated: left out."""
        rendered = self._render_history(model, messages, tools)
        if rendered is None:
            return None
        chain, _ = self._chains[model].chain_sync(prev, rendered[1].rstrip("\n"))
        return chain

    def truncate_tokens(self, model: str, text: str, n: int) -> str | None:
        """``text`` cut to its first ``n`` tokens of ``model``; None without a local tokenizer."""
        tok = self._tok.get(model)
        if tok is None:
            return None
        ids = tok.encode(text)
        return text if len(ids) <= n else tok.decode(ids[:n])

    def render_prefix(self, model: str, messages: Sequence[Mapping[str, Any]], tools: Any, marker: str
                      ) -> list[int] | None:
        """Tokens of the rendered ``messages`` up to the special token that opens the message holding
        ``marker`` (a placeholder): the prefix any next message will share."""
        rendered = self._render_history(model, messages, tools)
        if rendered is None:
            return None
        tok, text = rendered
        cut = text.find(marker)
        return None if cut < 0 else tok.encode(text[: tok.last_safe_split(text, cut)])


def _render_size(body: Mapping[str, Any]) -> int:
    """Roughly the characters a chat renders to: its text and the template's markup around each message."""
    msgs = body.get("messages")
    return text_chars("chat", body) + 32 * (len(msgs) if isinstance(msgs, list) else 0)


def _estimate(body: Mapping[str, Any]) -> int:
    """~4 characters a token: only for load estimates when the real tokens are unknown."""
    chars = 0
    for m in body.get("messages") or []:
        c = m.get("content") if isinstance(m, dict) else None
        chars += len(c) if isinstance(c, str) else sum(len(str(p)) for p in c or [])
    p = body.get("prompt")
    chars += len(p) if isinstance(p, str) else 0
    return max(1, chars // 4)
