"""Which message each token of a rendered chat prompt belongs to.

Templates write a message as a header, its text and a trailer; the text is printed verbatim (content,
reasoning, tool-call names, argument keys and string values). Each message's pieces are found in the
rendered text in order, and a message starts where the previous one's last piece ended: its header
belongs to it, the previous message's trailer (end token) is counted with it. One pass of ``str.find``
over the text, no re-rendering, so it is cheap enough to run whenever a prompt lost tokens.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from kvgate import safejson


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(str(p.get("text", "")) for p in content if isinstance(p, dict) and p.get("type") == "text")
    return ""


def _pieces(m: Mapping[str, Any]) -> Iterator[str]:
    for f in ("reasoning", "reasoning_content"):
        if isinstance(m.get(f), str) and m[f].strip():
            yield m[f].strip()
            break
    text = _text(m.get("content")).strip()
    if text:
        yield text
    for call in m.get("tool_calls") or []:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict):
            continue
        if isinstance(fn.get("name"), str) and fn["name"]:
            yield fn["name"]
        args = fn.get("arguments")
        if isinstance(args, str):
            args = safejson.try_loads(args)[1]
        if isinstance(args, dict):
            for k, v in args.items():
                yield json.dumps(k, ensure_ascii=False)
                if isinstance(v, str) and v:
                    yield json.dumps(v, ensure_ascii=False)[1:-1]


def message_char_starts(text: str, messages: Sequence[Mapping[str, Any]]) -> list[int]:
    """Character offset in ``text`` where each message starts."""
    starts: list[int] = []
    pos = 0
    for m in messages:
        starts.append(pos)
        for piece in _pieces(m):
            at = text.find(piece, pos)
            if at >= 0:
                pos = at + len(piece)
    return starts


def anchored_token_starts(text: str, anchor_chars: Sequence[int], anchor_tokens: Sequence[int],
                          messages: Sequence[Mapping[str, Any]]) -> list[int]:
    """Index of the first token of each message (the token->message map ``history.loss.message_at``
    reads), for a prompt known by its added-token anchors (character offset and token index of each
    added token, ``session.conversation.Chain``): a message starts at the first added token at or after
    where the previous message's text ended — its opening (or the previous message's closing) token, as
    the templates kvgate serves write them."""
    out = []
    for c in message_char_starts(text, messages):
        i = bisect.bisect_left(anchor_chars, c)
        out.append(anchor_tokens[i] if i < len(anchor_tokens) else (anchor_tokens[-1] if anchor_tokens else 0))
    return out
