"""``POST /v1/messages`` over the chat pipeline (a ``Front``) and ``POST /v1/messages/count_tokens``."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from starlette.requests import ClientDisconnect

from kvgate.errors import ApiError, NotFound
from kvgate.fronts.messages import stream, translate
from kvgate.fronts.messages.errors import error_body
from kvgate.fronts.messages.signing import Signer
from kvgate.gateway.auth import require
from kvgate.gateway.exchange import Prepared
from kvgate.gateway.prepare import read_json
from kvgate.gateway.requests import validate_chat
from kvgate.session import retention

if TYPE_CHECKING:
    from kvgate.gateway.parts import Parts


class MessagesFront:
    """One ``POST /v1/messages`` request's translation (a new one per request: it holds the request's
    ``retain_s``)."""

    name = "messages"

    def __init__(self, signer: Signer) -> None:
        self.signer = signer
        self.retain_s: float | None = None

    async def to_chat(self, body: dict[str, Any], headers: Mapping[str, str], tenant: str | None
                      ) -> dict[str, Any]:
        if _blocks(body) > TRANSLATE_INLINE_BLOCKS:
            # ~20 µs a block: thousands would hold every other request up.
            chat, self.retain_s = await asyncio.to_thread(_translated, body, self.signer)
        else:
            chat, self.retain_s = _translated(body, self.signer)
        return chat

    async def from_json(self, chat: dict[str, Any], prepared: Prepared) -> dict[str, Any]:
        return translate.from_chat(chat, self.signer)

    def from_stream(self, chunks: AsyncIterator[bytes], prepared: Prepared) -> AsyncIterator[bytes]:
        return stream.translate(chunks, self.signer)

    def error(self, status: int, err: ApiError | dict[str, Any]) -> dict[str, Any]:
        return error_body(status, err)


TRANSLATE_INLINE_BLOCKS = 1000
"""Requests with more content blocks than this are translated beside the event loop."""


def _translated(body: dict[str, Any], signer: Signer) -> tuple[dict[str, Any], float | None]:
    """The chat body and the retention its ``cache_control`` markers ask for (read once the translation
    accepted the request)."""
    chat = translate.to_chat(body, signer)
    return chat, retention.cache_control_s(body)


def _blocks(body: Mapping[str, Any]) -> int:
    msgs = body.get("messages")
    if not isinstance(msgs, list):
        return 0
    return len(msgs) + sum(len(m["content"]) for m in msgs
                           if isinstance(m, dict) and isinstance(m.get("content"), list))


def signer_for(gw: Parts) -> Signer:
    s = gw.settings
    secret = s.thinking_signature_secret or s.auth.cache_salt_secret
    return Signer(secret.get_secret_value().encode() if secret is not None else None)


def add_routes(app: FastAPI, gw: Parts) -> None:
    front = MessagesFront(signer_for(gw))

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        return await gw.proxy.handle(request, "chat", front=MessagesFront(front.signer))

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> Response:
        try:
            return JSONResponse(await _count(gw, front, request))
        except ApiError as exc:
            return JSONResponse(front.error(exc.status, exc), status_code=exc.status, headers=exc.headers)
        except ClientDisconnect:
            return Response(status_code=499)


async def _count(gw: Parts, front: MessagesFront, request: Request) -> dict[str, Any]:
    """The prompt's tokens as the model's chat template renders it (the tokens the engine would compute),
    from the local tokenizer or a worker's /tokenize; nothing is routed, recorded or admitted."""
    require(gw.auth, request.headers, proxy=True)
    s = gw.settings
    body = await read_json(request, s.max_body_bytes, s.hostile.json_limits)
    chat = await asyncio.to_thread(translate.to_chat, body, front.signer, True) \
        if _blocks(body) > TRANSLATE_INLINE_BLOCKS else translate.to_chat(body, front.signer, count=True)
    validate_chat(chat)
    model = chat["model"]
    if not gw.pool.serves(model):
        raise NotFound(f"The model `{model}` does not exist.", param="model", code="model_not_found")
    gw.prompt_limits.check_chars(model, "chat", chat)
    prompt = await gw.prompts.prepare(model, "chat", chat, None)
    return {"input_tokens": prompt.length}
