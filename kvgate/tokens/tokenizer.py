"""A model's tokenizer and chat template loaded from a Hugging Face style directory, without torch."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from kvgate.tokens.template import ChatTemplate


class ChatTokenizer:
    """Renders chat requests and tokenizes them exactly as vLLM's chat endpoint does.

    vLLM encodes a rendered chat prompt with ``add_special_tokens=False`` because the template
    already wrote the special tokens.
    """

    def __init__(self, model_dir: Path, sandbox: bool = True) -> None:
        """``sandbox``: render the chat template in Jinja's sandbox (``tokens/template.py``)."""
        self.model_dir = Path(model_dir)
        self._tok = Tokenizer.from_file(str(self.model_dir / "tokenizer.json"))
        cfg: dict[str, Any] = json.loads((self.model_dir / "tokenizer_config.json").read_text())
        source = cfg.get("chat_template")
        template_file = self.model_dir / "chat_template.jinja"
        if not isinstance(source, str) and template_file.exists():
            source = template_file.read_text()
        if not isinstance(source, str):
            raise ValueError(f"{model_dir}: no chat template found")
        special = {k: cfg.get(k) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
        self.template = ChatTemplate(source, {k: v for k, v in special.items() if isinstance(v, str)}, sandbox)
        # Every added token, special or not: tokenization never crosses one (incremental re-tokenization
        # splits there).
        self.special_tokens: tuple[str, ...] = tuple(
            str(v["content"]) for v in (cfg.get("added_tokens_decoder") or {}).values()
            if isinstance(v, dict) and v.get("content"))
        eos = cfg.get("eos_token")
        self.eos_token_id: int | None = self._tok.token_to_id(eos) if isinstance(eos, str) else None
        self.max_model_len = int(cfg.get("model_max_length", 4096))
        # No token covers more characters than its vocabulary string has (byte-level BPE spells each
        # byte as one character, and a character is at least one byte): prompt characters / this is a
        # lower bound on its tokens, known without tokenizing.
        self.max_token_chars = max((len(t) for t in self._tok.get_vocab(with_added_tokens=False)), default=1)

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size())

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def encode_with_starts(self, text: str) -> tuple[list[int], list[int]]:
        """Token ids and the character offset where each token starts (for incremental re-tokenization)."""
        enc = self._tok.encode(text, add_special_tokens=False)
        return list(enc.ids), [s for s, _ in enc.offsets]

    def encode_batch_with_starts(self, texts: list[str]) -> list[tuple[list[int], list[int]]]:
        """``encode_with_starts`` of several texts at once (``tokenizers`` spreads them over every core)."""
        return [(list(e.ids), [s for s, _ in e.offsets])
                for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def encode_anchored(self, texts: list[str], anchors: list[list[tuple[int, int]]], release_gil: bool = False
                        ) -> list[tuple[list[int], list[int | None]]]:
        """Token ids of each text and the index of the token at each of its ``anchors`` (character offset,
        the added token's id expected there, in order; None from the first anchor that is not such a
        token), without the offsets of every token (converting those costs a third as much as encoding).
        Each anchor's token is found by a scan of the ids in C from the one before, checked by its offset:
        ``Encoding.char_to_token`` walks the tokens from the start on every call, quadratic in a long
        text's anchors (13 ms of a 65k-token text's 115 ms). ``release_gil``: encode as a batch, which
        ``tokenizers`` runs without the GIL (work for a thread; a single encode holds it, stopping the
        event loop as surely as on it)."""
        encs = (self._tok.encode_batch(texts, add_special_tokens=False) if release_gil or len(texts) != 1
                else [self._tok.encode(texts[0], add_special_tokens=False)])
        out: list[tuple[list[int], list[int | None]]] = []
        for e, want in zip(encs, anchors, strict=True):
            ids: list[int] = e.ids  # a new list on each access: no copy needed
            at: list[int | None] = []
            j = 0
            for char, tid in want:
                try:
                    j = ids.index(tid, j)
                except ValueError:
                    break
                if (span := e.token_to_chars(j)) is None or span[0] != char:
                    break
                at.append(j)
                j += 1
            out.append((ids, at + [None] * (len(want) - len(at))))
        return out

    def plain_added_tokens(self) -> bool:
        """Whether every added token is matched as its exact text (not normalized, no strip, not single
        word): then the added tokens of a text are where their strings are."""
        return all(not (t.normalized or t.lstrip or t.rstrip or t.single_word)
                   for t in self._tok.get_added_tokens_decoder().values())

    def last_safe_split(self, text: str, before: int) -> int:
        """The start of the last special token at or before ``before``: tokenization never crosses a
        special token, so the text can be re-tokenized from there on its own. 0 if there is none."""
        best = 0
        for sp in self.special_tokens:
            i = text.rfind(sp, 0, before + 1)
            if i > best:
                best = i
        return best

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def token_to_id(self, token: str) -> int | None:
        tid = self._tok.token_to_id(token)
        return None if tid is None else int(tid)

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        return self.template.render(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, template_kwargs=template_kwargs
        )

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        return self.encode(self.render_chat(messages, tools, add_generation_prompt, template_kwargs))
