"""Rendered chat text into a chain of tokens, doing only the work routing needs.

Tokenization never crosses an added token (the template's special markers), so text splits there into
pieces that tokenize on their own:

- A known conversation: the new prompt shares its text with the conversation's chain up to some
  character; only the text from the last added token before it is tokenized again.
- A known conversation's turn that appends a long new text (a tool's output): routing needs only the
  conversation's chain and the first block the new text opens (the one block past the chain that some
  worker could hold: a retried turn still in flight); ``head`` tokenizes just that far, and the rest is
  tokenized once the request is on its way (``PromptBuilder.complete``).
- A long text (a cold conversation, or a large new message): the pieces are tokenized in growing batches
  beside the event loop (``tokenizers`` releases the GIL and encodes a batch on every core), and after
  each batch the caller may stop: routing needs the prompt's block hashes only as far as some worker
  holds them, so a cold 32k-token prompt whose history no worker has costs one small batch, not the
  whole text. The rest is tokenized when the turn's chain is built, after the response.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import re
from array import array
from collections.abc import Callable

from kvgate.sequences import common_prefix
from kvgate.session.conversation import Chain
from kvgate.tokens.tokenizer import ChatTokenizer

INLINE_CHARS = 16_384
"""Text up to this long is tokenized on the event loop (well under a millisecond)."""
FIRST_BATCH_CHARS = 8_192
"""A long text's first batch; each next one is four times larger."""

DEFER_CHARS = 2_048
"""A known conversation's new text longer than this is left for after routing (``head``); a shorter one
costs less to tokenize (~0.1 ms) than the second pass would."""
REST_CHARS = 8_192
"""``head`` only when the texts differ no earlier than this before the end of the conversation's chain
(within its last reply): an earlier change leaves nothing to save."""
HEAD_SLACK_CHARS = 64
"""Tokens starting this close to the end of a probed window are not trusted: the window's cut may change
how the last words split."""

Encoded = tuple[list[int], list[int], list[int]]
"""A piece encoded: its token ids, and the character offset and token index of each added token in it."""
Stop = Callable[[Chain], bool]
"""Given the chain so far, True when routing has what it needs."""


class ChainTokenizer:
    """One model's tokenizer with the added-token ids and the pattern that splits text at them."""

    def __init__(self, tok: ChatTokenizer) -> None:
        self.tok = tok
        self.added = frozenset(i for t in tok.special_tokens if (i := tok.token_to_id(t)) is not None)
        tokens = sorted(tok.special_tokens, key=len, reverse=True)
        self._split = re.compile("|".join(re.escape(t) for t in tokens)) if tokens else None
        self._anchored = self._split is not None and tok.plain_added_tokens()
        """Anchors found as the added tokens' strings, not from every token's offset."""
        self._ids = {t: i for t in tok.special_tokens if (i := tok.token_to_id(t)) is not None}
        self.retokenized_chars = 0

    async def chain(self, prev: Chain | None, text: str, stop: Stop | None = None
                    ) -> tuple[Chain, int | None, bool]:
        """``text`` as a chain, re-using ``prev``'s tokens up to the last added token before the first
        changed character. Returns the chain (of a prefix of ``text`` when ``stop`` ended it early), how
        many leading tokens were re-used (None: none) and whether the whole text was tokenized."""
        base, k, split = self._base(prev, text)
        self.retokenized_chars += len(text) - split
        if len(text) - split <= INLINE_CHARS or self._split is None:
            return self._whole(base, text, split), k, True
        pieces = self._pieces(text, split)
        chain, i, budget = base, 0, FIRST_BATCH_CHARS
        while i < len(pieces):
            batch: list[str] = []
            size = 0
            while i < len(pieces) and (not batch or size + len(pieces[i]) <= budget):
                batch.append(pieces[i])
                size += len(pieces[i])
                i += 1
            encoded = await asyncio.to_thread(self._encode_batch, batch)
            chain = self._append(chain, text, len(chain.text) if chain is not base else split, batch, encoded)
            if i < len(pieces) and stop is not None and stop(chain):
                return chain, k, False
            budget *= 4
        return chain, k, True

    def head(self, prev: Chain | None, text: str, block_size: int) -> Chain | None:
        """The chain of a prefix of ``text`` covering what it shares with ``prev``, the rest of ``prev``'s
        last message as ``text`` renders it and the first block past ``prev``'s tokens, when ``text``
        continues ``prev`` with more than ``DEFER_CHARS`` new characters; None otherwise (the caller
        tokenizes the whole text). Only the end of ``prev`` may differ (a template that renders the last
        reply otherwise once the conversation moved on): the loss explanation then finds the same first
        difference in the head as in the whole prompt. The new text is probed in a window encoded twice at
        two lengths: only tokens both agree on, away from the cut, are kept."""
        if prev is None or not prev.text:
            return None
        base, k, split = self._base(prev, text)
        rest = len(prev.text) - split  # prev's text past the last anchor kept: its last message's end
        if k is None or len(text) - split <= DEFER_CHARS or rest > REST_CHARS:
            return None
        want = max((k // block_size + 1) * block_size, len(prev.tokens) + 2) - k
        end = split + max(2 * rest, 8 * want) + 4 * HEAD_SLACK_CHARS
        if end + 4 * HEAD_SLACK_CHARS >= len(text):
            return None
        ids, starts = self.tok.encode_with_starts(text[split:end])
        again, _ = self.tok.encode_with_starts(text[split:end + 4 * HEAD_SLACK_CHARS])
        n = bisect.bisect_left(starts, end - split - HEAD_SLACK_CHARS) - 1
        if n < want or ids[:n] != again[:n]:
            return None
        self.retokenized_chars += end - split
        kept = [j for j in range(n) if ids[j] in self.added]
        return self._append(base, text, split, [text[split:split + starts[n]]],
                            [(ids[:n], [starts[j] for j in kept], kept)])

    def chain_sync(self, prev: Chain | None, text: str) -> tuple[Chain, int | None]:
        """The whole of ``text`` as a chain, on the calling thread (the turn's chain, built off the loop:
        encoded without the GIL)."""
        base, k, split = self._base(prev, text)
        self.retokenized_chars += len(text) - split
        return self._whole(base, text, split, release_gil=True), k

    def _whole(self, base: Chain, text: str, split: int, release_gil: bool = False) -> Chain:
        return self._append(base, text, split, [text[split:]], self._encode([text[split:]], release_gil))

    def _base(self, prev: Chain | None, text: str) -> tuple[Chain, int | None, int]:
        """What of ``prev`` stays valid for ``text``: its tokens up to the last added token (an anchor)
        before the first changed character — the texts agree up to there, so no scan is needed."""
        if prev is not None and prev.text:
            # The usual turn extends the chain's text: startswith compares in place, where the slices of
            # common_prefix copy both texts (38 us of a 34k-character prompt).
            same = len(prev.text) if text.startswith(prev.text) else common_prefix(prev.text, text)
            i = bisect.bisect_right(prev.anchor_chars, same) - 1
            if i >= 0 and prev.anchor_chars[i] > 0:
                split, k = prev.anchor_chars[i], prev.anchor_tokens[i]
                # Block hashes carry over for the blocks wholly inside the kept tokens.
                kept = {key: (bs, h[: k // bs], n[: k // bs]) for key, (bs, h, n) in prev.hashes.items()}
                return (Chain(text[:split], prev.tokens[:k], prev.anchor_chars[:i], prev.anchor_tokens[:i],
                              hashes=kept), k, split)
        return Chain("", array("I"), array("I"), array("I")), None, 0

    def _pieces(self, text: str, start: int) -> list[str]:
        assert self._split is not None
        cuts = [m.start() for m in self._split.finditer(text, start)]
        bounds = [start, *(c for c in cuts if c > start), len(text)]
        return [text[a:b] for a, b in itertools.pairwise(bounds) if b > a]

    def _encode_batch(self, pieces: list[str]) -> list[Encoded]:
        return self._encode(pieces, release_gil=True)

    def _encode(self, pieces: list[str], release_gil: bool) -> list[Encoded]:
        """Per piece: its ids, and the character offset and token index of each added token in it."""
        if self._anchored:
            assert self._split is not None
            found = [[(m.start(), self._ids.get(m.group(), -1)) for m in self._split.finditer(p)] for p in pieces]
            got = self.tok.encode_anchored(pieces, found, release_gil)
            out: list[Encoded] = []
            for (ids, toks), anchors in zip(got, found, strict=True):
                if None in toks:
                    break  # an added token's string not tokenized as it: read every token's offset
                out.append((ids, [c for c, _ in anchors], [t for t in toks if t is not None]))
            else:
                return out
        encoded = (self.tok.encode_batch_with_starts(pieces) if release_gil or len(pieces) != 1
                   else [self.tok.encode_with_starts(pieces[0])])
        return [(ids, [starts[j] for j, t in enumerate(ids) if t in self.added],
                 [j for j, t in enumerate(ids) if t in self.added]) for ids, starts in encoded]

    def _append(self, chain: Chain, text: str, at: int, pieces: list[str], encoded: list[Encoded]) -> Chain:
        """``chain`` (the chain of ``text[:at]``) extended with the encoded ``pieces`` that follow."""
        tokens = array("I", chain.tokens)
        chars, toks = array("I", chain.anchor_chars), array("I", chain.anchor_tokens)
        pos = at
        for piece, (ids, anchor_chars, anchor_tokens) in zip(pieces, encoded, strict=True):
            t0 = len(tokens)
            chars.extend(pos + c for c in anchor_chars)
            toks.extend(t0 + j for j in anchor_tokens)
            tokens.extend(ids)
            pos += len(piece)
        return Chain(text[:pos], tokens, chars, toks, hashes=dict(chain.hashes))
