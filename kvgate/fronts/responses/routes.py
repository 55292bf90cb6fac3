"""``/v1/responses``: create (over the chat pipeline), retrieve, delete, list input items.

A response id is ``resp_`` + the worker's chat completion id, which the conversation record keeps
(``responses``): ``previous_response_id`` continues on any replica sharing the conversation store, and
the pipeline answers another tenant's id as unknown (404).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from kvgate.clock import Clock
from kvgate.config import GatewaySettings
from kvgate.errors import ApiError, BadRequest, Conflict, NotFound, error_body
from kvgate.fronts.responses import translate as t
from kvgate.fronts.responses.items import to_messages
from kvgate.fronts.responses.store import MemoryResponseStore, RedisResponseStore, ResponseStore, Stored
from kvgate.fronts.responses.stream import translate_stream
from kvgate.gateway.auth import Authenticator, require
from kvgate.gateway.exchange import Prepared
from kvgate.kvstore.conversations import ConversationStore, StoreError
from kvgate.router.types import ConversationId
from kvgate.session.conversation import Conversation
from kvgate.session.retention import prompt_cache_retention_s


def make_response_store(settings: GatewaySettings, clock: Clock) -> ResponseStore:
    """Beside the conversations: in Redis under the same prefix when they are, else in this process."""
    if settings.session_store == "redis":
        return RedisResponseStore(settings.redis_url, settings.session_ttl_s, settings.redis_prefix,
                                  cluster=settings.redis_cluster)
    return MemoryResponseStore(clock, settings.session_ttl_s, settings.max_store_bytes // 8)


@dataclass(frozen=True, slots=True)
class Deps:
    conversations: ConversationStore
    responses: ResponseStore


class ResponsesFront:
    """One ``POST /v1/responses`` request's translation (a new one per request: it holds the request)."""

    name = "responses"

    def __init__(self, deps: Deps) -> None:
        self.deps = deps
        self.req: t.Request | None = None
        self.created = time.time()
        self.retain_s: float | None = None

    async def to_chat(self, body: dict[str, Any], headers: Mapping[str, str], tenant: str | None
                      ) -> dict[str, Any]:
        req = self.req = t.read_request(body)
        self.retain_s = prompt_cache_retention_s(body.get("prompt_cache_retention"))
        known: tuple[str, ...] = ()
        previous: str | None = None
        system = [{"role": "system", "content": req.instructions}] if req.instructions is not None else []
        if req.previous is not None:
            previous, conv = await self._previous(req.previous, tenant or "")
            known = _call_ids(conv.history)
            system = _instructions(conv, req.instructions)
        messages = system + to_messages(req.items, known)
        return t.chat_body(req, body, messages, previous)

    async def _previous(self, resp_id: str, tenant: str) -> tuple[str, Conversation]:
        """The chat id a ``previous_response_id`` names and its conversation (404: unknown, expired,
        deleted, ``store: false`` or another tenant's; 409: not the conversation's latest response)."""
        chat_id = t.chat_id_of(resp_id)
        conv = None
        try:
            cid = await self.deps.conversations.conversation_of(chat_id) if chat_id else None
            conv = await self.deps.conversations.get(cid) if cid is not None else None
        except StoreError as exc:
            raise NotFound(f"response '{resp_id}' cannot be looked up now ({exc})", param="previous_response_id",
                           code="response_not_found") from exc
        if conv is None or conv.tenant != tenant or chat_id not in conv.responses or not conv.history:
            raise NotFound(f"Previous response with id '{resp_id}' not found.", param="previous_response_id",
                           code="response_not_found")
        assert chat_id is not None
        if conv.responses[-1] != chat_id:
            # The record holds the conversation as of its latest response only: continuing an earlier one
            # would silently answer from the wrong history.
            raise Conflict(f"response '{resp_id}' is not the latest of its conversation; kvgate continues only "
                           "the latest (resend the input without previous_response_id to branch).",
                           param="previous_response_id", code="response_not_latest")
        return chat_id, conv

    async def from_json(self, chat: dict[str, Any], prepared: Prepared) -> dict[str, Any]:
        assert self.req is not None
        chat_id = t.text_or(chat.get("id"), "unknown")
        choices = chat.get("choices")
        choice = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
        message = choice.get("message")
        message = message if isinstance(message, dict) else {}
        resp = t.response_object(self.req, t.response_id(chat_id), t.output_items(chat_id, message), "completed",
                                 t.usage(chat.get("usage")), self.created, choice.get("finish_reason"))
        await self._keep(resp, prepared)
        return resp

    def from_stream(self, chunks: AsyncIterator[bytes], prepared: Prepared) -> AsyncIterator[bytes]:
        assert self.req is not None

        async def done(resp: dict[str, Any]) -> None:
            await self._keep(resp, prepared)

        return translate_stream(chunks, self.req, self.created, done)

    async def _keep(self, resp: dict[str, Any], prepared: Prepared) -> None:
        assert self.req is not None
        if not self.req.store or resp["status"] == "failed":
            return
        items = t.input_item_list(self.req.items, resp["id"])
        await self.deps.responses.put(resp["id"], Stored(prepared.ident.tenant, resp, items))

    def error(self, status: int, err: ApiError | dict[str, Any]) -> dict[str, Any]:
        return openai_error(status, err)


def openai_error(status: int, err: ApiError | dict[str, Any]) -> dict[str, Any]:
    if isinstance(err, ApiError):
        return err.body()
    e = err.get("error")
    if isinstance(e, dict) and isinstance(e.get("message"), str):
        return error_body(e["message"], str(e.get("type") or "upstream_error"),
                          e.get("param") if isinstance(e.get("param"), str) else None,
                          e.get("code") if isinstance(e.get("code"), str | int) else None)
    msg = e if isinstance(e, str) else err.get("message") if isinstance(err.get("message"), str) else None
    return error_body(msg or f"The worker answered {status}.", "upstream_error", None, status)


def _call_ids(history: tuple[Mapping[str, Any], ...]) -> tuple[str, ...]:
    return tuple(str(c.get("id")) for m in history if m.get("role") == "assistant"
                 for c in (m.get("tool_calls") or []) if isinstance(c, dict) and c.get("id"))


def _instructions(conv: Conversation, instructions: str | None) -> list[dict[str, Any]]:
    """Instructions beside ``previous_response_id``: the stored conversation already starts with them
    (agents resend the same ones every step), so they are not sent again; other instructions would
    replace the prefix the stored history starts with, which a continuation cannot do."""
    if instructions is None:
        return []
    first = conv.history[0] if conv.history else {}
    if first.get("role") in ("system", "developer") and first.get("content") == instructions:
        return []
    raise Conflict("'instructions' differ from those the stored conversation starts with; kvgate cannot replace "
                   "them in a continuation (resend the input without previous_response_id).",
                   param="instructions", code="history_conflict")


def responses_routes(proxy: Any, auth: Authenticator | None, settings: GatewaySettings, deps: Deps) -> APIRouter:
    router = APIRouter()

    def tenant_of(request: Request) -> str:
        principal = require(auth, request.headers, proxy=True) if auth is not None else None
        if principal is not None and settings.auth.enabled:
            return principal.tenant or ""
        return request.headers.get(settings.tenant_header, "") or ""

    async def lookup(request: Request, resp_id: str) -> Stored:
        stored = await deps.responses.get(resp_id, tenant_of(request))
        if stored is None:
            raise NotFound(f"No response found with id '{resp_id}'.", param="response_id", code="response_not_found")
        return stored

    @router.post("/v1/responses")
    async def create(request: Request) -> Response:
        result: Response = await proxy.handle(request, "chat", front=ResponsesFront(deps))
        return result

    @router.get("/v1/responses/{resp_id}")
    async def retrieve(request: Request, resp_id: str) -> JSONResponse:
        if request.query_params.get("stream") in ("true", "1"):
            raise BadRequest("Streaming a stored response again is not supported by kvgate.", param="stream",
                             code="unsupported_parameter")
        return JSONResponse((await lookup(request, resp_id)).response)

    @router.delete("/v1/responses/{resp_id}")
    async def delete(request: Request, resp_id: str) -> JSONResponse:
        tenant = tenant_of(request)
        if not await deps.responses.delete(resp_id, tenant):
            raise NotFound(f"No response found with id '{resp_id}'.", param="response_id", code="response_not_found")
        await _forget(deps.conversations, resp_id, tenant)
        return JSONResponse({"id": resp_id, "object": "response.deleted", "deleted": True})

    @router.get("/v1/responses/{resp_id}/input_items")
    async def input_items(request: Request, resp_id: str) -> JSONResponse:
        stored = await lookup(request, resp_id)
        return JSONResponse(_page(stored.input_items, request.query_params))

    return router


async def _forget(store: ConversationStore, resp_id: str, tenant: str) -> None:
    """A deleted response cannot be continued either: its id leaves the conversation's record."""
    chat_id = t.chat_id_of(resp_id)
    try:
        cid = await store.conversation_of(chat_id) if chat_id else None
        if cid is None:
            return

        def drop(cur: Conversation | None) -> Conversation | None:
            if cur is None or cur.tenant != tenant or chat_id not in cur.responses:
                return None
            return replace(cur, responses=tuple(r for r in cur.responses if r != chat_id), body_gen=cur.body_gen + 1)

        await store.update(ConversationId(cid), drop)
    except StoreError:
        pass  # the object is gone; the record's id expires with the session TTL


def _page(items: list[dict[str, Any]], q: Mapping[str, str]) -> dict[str, Any]:
    order = q.get("order", "desc")
    if order not in ("asc", "desc"):
        raise BadRequest("'order' must be 'asc' or 'desc'.", param="order", code="invalid_value")
    try:
        limit = int(q.get("limit", "20"))
    except ValueError:
        limit = -1
    if not 1 <= limit <= 100:
        raise BadRequest("'limit' must be an integer from 1 to 100.", param="limit", code="invalid_value")
    seq = items if order == "asc" else items[::-1]
    after = q.get("after")
    if after is not None:
        ids = [it.get("id") for it in seq]
        seq = seq[ids.index(after) + 1:] if after in ids else []
    page = seq[:limit]
    return {"object": "list", "data": page, "first_id": page[0].get("id") if page else None,
            "last_id": page[-1].get("id") if page else None, "has_more": len(seq) > limit}
