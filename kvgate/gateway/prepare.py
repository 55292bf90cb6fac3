"""A request before it is routed: read and validated, its conversation identified and loaded, its history
made canonical, its prompt tokenized and hashed, and the session controller told it arrived.

Nothing here writes conversation state: a request that fails later leaves its conversation as it was.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from fastapi import Request

from kvgate import safejson
from kvgate.admission.gate import Admission, Ticket
from kvgate.admission.settings import Priority
from kvgate.config import GatewaySettings
from kvgate.errors import BadRequest, Conflict, NotFound, PayloadTooLarge
from kvgate.gateway import identity
from kvgate.gateway.auth import Principal, tenant_salt
from kvgate.gateway.exchange import Endpoint, Prepared, Turn
from kvgate.gateway.inputlimits import PromptLimits, text_chars
from kvgate.gateway.prompts import Held, Prompt, PromptBuilder
from kvgate.gateway.requests import KVGATE_FIELDS, validate_chat, validate_completion
from kvgate.gateway.runtime import SessionRuntime
from kvgate.gateway.send import until_disconnect
from kvgate.gateway.telemetry import GatewayMetrics
from kvgate.gateway.tracing import OFF, RequestTrace
from kvgate.gateway.turns import TurnService
from kvgate.gateway.workers import WorkerPool
from kvgate.history.continuation import HistoryConflict, UnknownResponse
from kvgate.kvstore.conversations import StoreError
from kvgate.kvstore.grouping import GroupingIndex
from kvgate.router.types import ConversationId
from kvgate.safejson import DEFAULT_LIMITS, JsonLimits
from kvgate.session import regroup
from kvgate.session.conversation import Conversation
from kvgate.session.retention import prompt_cache_retention_s

log = logging.getLogger(__name__)

FORWARD_HEADERS = ("authorization", "x-request-id", "traceparent", "tracestate")
"""Auth off only; with auth on the client's ``authorization`` is its credential to kvgate, never the worker's."""


async def read_json(request: Request, limit: int, limits: JsonLimits = DEFAULT_LIMITS) -> dict[str, Any]:
    """The body as a JSON object, under ``limit`` bytes (413), well-formed and within ``limits`` (400)."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"Request body of {declared} bytes exceeds the limit of {limit} bytes.",
                              code="request_too_large")
    buf = bytearray()
    async for chunk in request.stream():
        buf += chunk
        if len(buf) > limit:
            raise PayloadTooLarge(f"Request body exceeds the limit of {limit} bytes.", code="request_too_large")
    return await parse_object(bytes(buf), limits)


PARSE_INLINE_BYTES = 256 * 1024
"""Bodies up to this size are parsed on the event loop; a larger one (up to 8 MB: ~50 ms of parsing and
checking) in a thread, so other requests are not held up behind it."""


async def parse_object(data: bytes, limits: JsonLimits = DEFAULT_LIMITS, what: str = "Request body",
                       param: str | None = None) -> dict[str, Any]:
    """``data`` as a JSON object (safejson: depth, number length, no NaN/Infinity, valid Unicode), or 400."""
    try:
        body = safejson.loads(data, limits) if len(data) <= PARSE_INLINE_BYTES \
            else await asyncio.to_thread(safejson.loads, data, limits)
    except safejson.JsonRejected as exc:
        raise BadRequest(f"{what} is not acceptable JSON: {exc.reason}", param=param, code="invalid_json") from None
    if not isinstance(body, dict):
        raise BadRequest(f"{what} must be a JSON object.", param=param, code="invalid_json")
    return body


ESTIMATE_CHARS_PER_TOKEN = 4
"""The prompt's tokens as admission first counts them, from its text alone (OpenAI's rule of thumb for
English); the count is settled once the prompt is tokenized."""

Guard = Callable[[Awaitable[Ticket]], Awaitable[Ticket]]


def estimate_tokens(endpoint: Endpoint, body: Mapping[str, Any]) -> int:
    return text_chars(endpoint, body) // ESTIMATE_CHARS_PER_TOKEN


VALIDATE_INLINE_MESSAGES = 512
"""Requests with more messages are validated in a thread."""


class Preparer:
    def __init__(self, settings: GatewaySettings, pool: WorkerPool, turns: TurnService, prompts: PromptBuilder,
                 runtime: SessionRuntime, metrics: GatewayMetrics, held_for: Callable[[str], Held] | None = None,
                 limits: PromptLimits | None = None, admission: Admission | None = None,
                 grouping: GroupingIndex | None = None) -> None:
        self.settings = settings
        self.grouping = grouping
        """Keyless conversations found again after a compaction (session/regroup.py); None: off."""
        self.admission = admission
        """Admission on: the proxy's requests are admitted here, once the tenant and the prompt's tokens
        are known and before anything is written for them."""
        self.limits = limits
        self.held_for = held_for
        """Which blocks the fleet holds: a conversation without a chain is tokenized only as far as
        that matters for routing (not with a remote tier to ask, which needs the whole prompt)."""
        self.pool = pool
        self.turns = turns
        self.prompts = prompts
        self.runtime = runtime
        self.metrics = metrics

    async def prepare(self, request: Request, endpoint: Endpoint, trace: RequestTrace = OFF,
                      principal: Principal | None = None,
                      translate: Callable[[dict[str, Any]], Awaitable[dict[str, Any]]] | None = None) -> Prepared:
        """``translate``: another protocol's body into the ``endpoint``'s (gateway/front.py)."""
        body = await read_json(request, self.settings.max_body_bytes, self.settings.hostile.json_limits)
        if translate is not None:
            body = await translate(body)
        return await self.prepare_body(body, request.headers, endpoint, trace=trace, principal=principal,
                                       admit=self.admission is not None,
                                       guard=lambda aw: until_disconnect(request, aw), defer=True)

    async def prepare_body(self, body: dict[str, Any], headers: Mapping[str, str], endpoint: Endpoint, *,
                           act: bool = True, trace: RequestTrace = OFF, principal: Principal | None = None,
                           admit: bool = False, guard: Guard | None = None, defer: bool = False) -> Prepared:
        """A parsed request body and its headers, prepared (the HTTP front, the endpoint picker and the
        control API's "where would this go" share it). ``act``: run the session controller's arrival
        commands (False for a question that sends nothing). ``principal``: the authenticated caller; with
        auth on, its tenant replaces the tenant header and its salt goes into the body. ``admit``: hold the
        request to its tenant's quota and a fleet slot (the HTTP front with admission on); the ticket in
        the result must be released when the request ends. ``guard``: wraps the wait for a slot (the HTTP
        front gives up on it when the client disconnects). ``defer``: a long new text appended to the
        conversation may be tokenized after routing (the caller runs ``Prepared.finish_prompt`` once the
        request is sent: the HTTP front's ``Sender``)."""
        gate = self.admission if admit else None
        priority = gate.priority(headers) if gate is not None else None  # a bad header: 400 at once
        msgs = body.get("messages")
        if isinstance(msgs, list) and len(msgs) > VALIDATE_INLINE_MESSAGES:
            # ~3.5 µs a message: tens of thousands would hold every other request up.
            await asyncio.to_thread(self._check, body, endpoint)
        else:
            self._check(body, endpoint)
        model = body["model"]
        trace.mark("identify")
        auth = self.settings.auth
        tenant = principal.tenant if principal is not None and auth.enabled else None
        ident = self._identify(headers, body, tenant)
        salt = tenant_salt(auth, tenant) if tenant is not None else None
        if salt is not None:
            # Overrides whatever the client sent: a client-chosen salt could name another tenant's.
            body = {**body, "cache_salt": salt}
        ticket: Ticket | None = None
        if gate is not None and priority is not None:
            trace.mark("admission")
            # Before anything costs more than counting characters (a refused request is cheap, and a waiting
            # one holds no rendered prompt) and before the session controller hears of it (a refused one
            # leaves no trace in any state). Its prompt tokens are estimated here and settled once counted.
            admitted = gate.admit(ident.tenant, model, priority, estimate_tokens(endpoint, body))
            ticket = await (guard(admitted) if guard is not None else admitted)
        try:
            return await self._prepared(body, headers, endpoint, act, trace, principal, model, ident, salt, ticket,
                                        priority, defer)
        except BaseException:
            if ticket is not None:
                ticket.release()
            raise

    async def _prepared(self, body: dict[str, Any], headers: Mapping[str, str], endpoint: Endpoint, act: bool,
                        trace: RequestTrace, principal: Principal | None, model: str, ident: identity.Identity,
                        salt: str | None, ticket: Ticket | None, priority: Priority | None, defer: bool = False
                        ) -> Prepared:
        conv, ident, body = await self._conversation(ident, body, endpoint)
        turn = None
        if endpoint == "chat":
            trace.mark("canonicalise")
            turn, body = self._canonical(headers, body, ident, conv, model)
        trace.mark("tokenize")
        chain = conv.chain if conv is not None else None
        # Not with a remote tier to ask: its lookup reads the whole prompt's tokens.
        held = self.held_for(model) if self.held_for and not self.settings.tier_redis_url else None
        prompt = await self.prompts.prepare(model, endpoint, body, chain, held, defer and endpoint == "chat",
                                            self.limits.limit(model) if self.limits is not None else None)
        if self.limits is not None and prompt.source != "estimate":
            # Exact when complete; a prefix (tokenizing stopped early) is still a lower bound.
            self.limits.check_tokens(model, prompt.length if prompt.complete else len(prompt.tokens or ()))
        if prompt.text is None:  # else counted once tokenized whole (``_finisher``)
            self.metrics.count_routed_prompt_tokens(model, prompt.source, prompt.length)
        if ticket is not None and priority is not None:
            ticket.prompt(prompt.length)
            body = self._worker_priority(body, model, priority)
        prepared = self._finish(body, headers, endpoint, act, trace, principal, model, ident, conv, turn, prompt,
                                salt, ticket)
        if prompt.text is not None:
            prepared.finish_prompt = self._finisher(model, prompt, body.get("cache_salt"))
        if conv is None and ident.parent is not None:
            parent = await self._load(ident.parent)
            prepared.parent_home = parent.home if parent is not None and parent.tenant == ident.tenant else None
        return prepared

    def _finish(self, body: dict[str, Any], headers: Mapping[str, str], endpoint: Endpoint, act: bool,
                trace: RequestTrace, principal: Principal | None, model: str, ident: identity.Identity,
                conv: Conversation | None, turn: Turn | None, prompt: Prompt, salt: str | None,
                ticket: Ticket | None) -> Prepared:
        auth = self.settings.auth
        if turn is not None:
            turn.loss = self.turns.explain(conv, prompt, self.prompts.block_size(model), turn.canonical)
            turn.strip_ids = self._wants_ids(body, model)
        payload, stream, hide = _forward(body, turn is not None and turn.strip_ids)
        msgs = body.get("messages") if endpoint == "chat" else None
        user_turn = isinstance(msgs, list) and bool(msgs) and isinstance(msgs[-1], dict) \
            and msgs[-1].get("role") == "user"
        trace.mark("session")
        now = time.time()
        arrival = self.runtime.controller.arrived(conv.session if conv is not None else _NEW.session,
                                                  tenant=ident.tenant, now=now, user_turn=user_turn)
        task = self.runtime.spawn(self.runtime.execute(ident.conversation_id, conv, arrival.commands),
                                  f"arrival:{ident.conversation_id}") if act and arrival.commands else None
        fwd = {k: v for k, v in headers.items() if k in FORWARD_HEADERS and not (auth.enabled and k == "authorization")}
        if auth.worker_api_key is not None:
            fwd["authorization"] = f"Bearer {auth.worker_api_key.get_secret_value()}"
        # kvgate's cache figures (x-kvgate-expected-cached-tokens): with a salt they count only prefixes
        # of the caller's own salt (its tenant or sharing group); unsalted, they could count another
        # tenant's, so then only an operator sees them.
        show = not auth.enabled or salt is not None or (principal is not None and principal.operator)
        return Prepared(endpoint, model, ident, conv, prompt, payload, fwd, stream, hide, arrival, now,
                        user_turn, turn, task, trace, show, salt, ticket, store_response=body.get("store") is not False,
                        retain_s=prompt_cache_retention_s(body.get("prompt_cache_retention")))

    def _finisher(self, model: str, prompt: Prompt, salt: Any) -> Callable[[], Prompt]:
        """``prompt`` tokenized whole, for a thread once the request is sent."""
        def finish() -> Prompt:
            whole = self.prompts.complete(model, prompt, salt if isinstance(salt, str) else None)
            self.metrics.count_routed_prompt_tokens(model, whole.source, whole.length)
            return whole

        return finish

    def _worker_priority(self, body: dict[str, Any], model: str, priority: str) -> dict[str, Any]:
        """The request's class as vLLM's ``priority`` (lower first; SGLang: higher first), when configured and
        the model's workers all read it one way."""
        s = self.settings.admission
        if not s.worker_priority:
            return body
        n = s.interactive_priority if priority == "interactive" else s.batch_priority
        engines = {w.config.engine for w in self.pool.all() if w.config.model == model}
        if engines <= {"vllm", "sim"}:
            return {**body, "priority": n}
        if engines == {"sglang"}:
            return {**body, "priority": -n}
        return body

    def _check(self, body: dict[str, Any], endpoint: Endpoint) -> None:
        (validate_chat if endpoint == "chat" else validate_completion)(body)
        model = body["model"]
        if not self.pool.serves(model):
            raise NotFound(f"The model `{model}` does not exist.", param="model", code="model_not_found")
        if self.limits is not None:  # before anything costs more than counting characters
            self.limits.check_chars(model, endpoint, body)

    def _wants_ids(self, body: dict[str, Any], model: str) -> bool:
        """Ask for the engine's token ids (the loss explanation compares what it really cached): vLLM
        workers only, and not when the client asked for them itself (then they are the client's)."""
        return self.settings.engine_token_ids and "return_token_ids" not in body and all(
            w.config.engine == "vllm" for w in self.pool.all() if w.config.model == model)

    def _identify(self, headers: Mapping[str, str], body: dict[str, Any], tenant: str | None = None
                  ) -> identity.Identity:
        try:
            ident = identity.resolve(headers, body, self.settings.conversation_headers,
                                     self.settings.tenant_header, tenant, harness=self.settings.harness_session_keys)
        except identity.BadIdentity as exc:
            raise BadRequest(str(exc), param=exc.param, code="invalid_conversation_id") from exc
        self.metrics.conversation_source.labels(ident.source.split(":")[0]).inc()
        return ident

    async def _conversation(self, ident: identity.Identity, body: dict[str, Any], endpoint: Endpoint
                            ) -> tuple[Conversation | None, identity.Identity, dict[str, Any]]:
        rid = body.get("previous_response_id") if endpoint == "chat" else None
        if not rid:
            conv = await self._load(ident.conversation_id)
            if conv is None and ident.source == "derived" and self.grouping is not None and endpoint == "chat":
                conv, ident = await self._regroup(ident, body["messages"])
            return conv, ident, body
        # Stateful continuation: the client sends only what is new; kvgate holds the rest.
        try:
            cid = await self.runtime.store.conversation_of(rid)
            conv = await self._load(cid) if cid is not None else None
            if conv is None or conv.tenant != ident.tenant:  # another tenant's response does not exist
                raise UnknownResponse(f"no stored conversation has response `{rid}`")
            full = self.turns.continue_from(conv, body["messages"])
        except UnknownResponse as exc:
            raise NotFound(str(exc), param="previous_response_id", code="response_not_found") from exc
        except HistoryConflict as exc:
            raise Conflict(str(exc), param=f"messages[{exc.index}]", code="history_conflict") from exc
        except StoreError as exc:
            raise NotFound(f"response `{rid}` cannot be looked up now ({exc})", param="previous_response_id",
                           code="response_not_found") from exc
        return conv, identity.Identity(conv.id, "previous_response_id", ident.tenant), {**body, "messages": full}

    async def _regroup(self, ident: identity.Identity, messages: list[Any]
                       ) -> tuple[Conversation | None, identity.Identity]:
        """A keyless request whose derived key names no conversation: the one its messages were filed under,
        if one leads (it compacted or rewound), else a new conversation under the derived key."""
        assert self.grouping is not None
        digests = regroup.lookup_digests(messages, ident.conversation_id)
        cid = regroup.vote(await self.grouping.lookup(ident.tenant, digests))
        conv = await self._load(cid) if cid is not None else None
        if conv is None or conv.tenant != ident.tenant:
            return None, ident
        self.metrics.regrouped.inc()
        return conv, identity.Identity(conv.id, "regrouped", ident.tenant, alias=ident.conversation_id)

    async def _load(self, cid: ConversationId) -> Conversation | None:
        try:
            return await self.runtime.store.get(cid)
        except StoreError as exc:
            # The store is down: route without the conversation's history rather than fail.
            self.metrics.session_store_errors.inc()
            log.warning("conversation store: %s", exc)
            return None

    def _canonical(self, headers: Mapping[str, str], body: dict[str, Any], ident: identity.Identity,
                   conv: Conversation | None, model: str) -> tuple[Turn, dict[str, Any]]:
        """The history the engine sees: exact replies restored, completed turns canonical."""
        requested = body.get("reasoning_policy") or headers.get("x-kvgate-reasoning-policy")
        protocol = self.turns.protocol(model, ident.tenant, requested)
        canonical = self.turns.canonical(protocol, body["messages"], conv, model)
        for r in canonical.restored:
            self.metrics.restored.labels(r.field.split(":")[0]).inc()
        return Turn(canonical, protocol, body.get("tools")), {**body, "messages": canonical.messages}


_NEW = Conversation(ConversationId(""))


def _forward(body: dict[str, Any], token_ids: bool) -> tuple[bytes, bool, bool]:
    """(the body the worker gets, streamed?, usage hidden from the client?)."""
    fwd = {k: v for k, v in body.items() if k not in KVGATE_FIELDS}
    if token_ids:
        fwd["return_token_ids"] = True
    stream = bool(body.get("stream"))
    hide = False
    if stream:
        opts = body.get("stream_options") or {}
        if not opts.get("include_usage"):
            # kvgate needs usage for every response; the client did not ask, so keep it out of its stream.
            fwd["stream_options"] = {**opts, "include_usage": True}
            hide = True
    # Written again even where kvgate changed nothing (the raw bytes would save ~6 µs on a 33 kB body): the
    # worker must read the document kvgate validated, not the client's text, whose duplicate keys an
    # engine's parser may resolve otherwise than kvgate's did.
    return safejson.dumps(fwd), stream, hide
