"""The simulated worker's HTTP server: vLLM's or SGLang's OpenAI-compatible wire format (``dialects.py``)
over ``EngineCore``."""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from kvgate.clock import Clock, MonotonicClock
from kvgate.sim.behaviour import BadSimSpec, script_for
from kvgate.sim.dialects import dialect_for
from kvgate.sim.engine import EngineCore, SimRequest, TokenOutput
from kvgate.sim.events import KVEventPublisher
from kvgate.sim.kinds import make_hasher
from kvgate.sim.output import Delta, RenderedOutput, tool_call_json
from kvgate.sim.runner import EngineRunner
from kvgate.sim.settings import SimSettings
from kvgate.sim.timing import get_profile
from kvgate.tokens.template import TemplateError
from kvgate.tokens.tinymodel import ensure_tiny_model
from kvgate.tokens.tokenizer import ChatTokenizer

T = TypeVar("T")
log = logging.getLogger(__name__)

# Fields of vLLM's request models that the simulator reads or that are legal but irrelevant to it.
_COMMON_FIELDS = frozenset({
    "model", "stream", "stream_options", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
    "n", "seed", "stop", "stop_token_ids", "ignore_eos", "presence_penalty", "frequency_penalty", "user",
    "cache_salt", "logprobs", "min_tokens", "request_id", "priority", "sim", "repetition_penalty",
})
_CHAT_FIELDS = _COMMON_FIELDS | {"messages", "tools", "tool_choice", "parallel_tool_calls", "chat_template_kwargs",
                                 "response_format", "top_logprobs", "add_generation_prompt", "reasoning_effort"}
_COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt", "echo", "suffix", "best_of"}


class SimWorker:
    """One simulated vLLM worker: tokenizer, engine core, real-time runner, optional KV events."""

    def __init__(self, settings: SimSettings, clock: Clock | None = None) -> None:
        self.settings = settings
        model_dir = Path(settings.model_dir) if settings.model_dir else ensure_tiny_model()
        self.tokenizer = ChatTokenizer(model_dir)
        self.model_dir = model_dir
        profile = get_profile(settings.profile)
        overrides: dict[str, int] = {}
        if settings.block_size:
            overrides["block_size"] = settings.block_size
        if settings.num_blocks:
            overrides["num_blocks"] = settings.num_blocks
        if settings.max_num_seqs:
            overrides["max_num_seqs"] = settings.max_num_seqs
        self.profile = profile.with_overrides(**overrides)
        self.dialect = dialect_for(settings.engine, settings.enable_cache_report)
        self.hasher = make_hasher(self.dialect.kind, self.profile.block_size, settings.hash_algo, settings.hash_seed)
        pool = None
        if settings.hicache_ratio is not None:
            from kvgate.sim.hicache import HiCachePool

            blocks = self.profile.num_blocks
            pool = HiCachePool(blocks, self.profile.block_size, max(1, int(blocks * settings.hicache_ratio)))
        self.core = EngineCore(self.profile, self.hasher, kind=self.dialect.kind, pool=pool)
        self.clock = clock or MonotonicClock(settings.speed)
        self.publisher: KVEventPublisher | None = None
        self.runner = EngineRunner(self.core, self.clock, self._publish)
        self._ids = itertools.count()
        self.in_flight = 0
        self.ignored_fields: list[str] = []
        """Top-level request fields this worker did not use, as vLLM warns about them."""
        self.started_at = time.time()

    def _publish(self, events: list[Any]) -> None:
        if self.publisher is not None:
            self.publisher.publish(events)

    # -- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        s = self.settings
        self.started_at = time.time()
        if s.kv_events_endpoint:
            self.publisher = KVEventPublisher(s.kv_events_endpoint, s.kv_replay_endpoint, s.kv_events_topic,
                                              kind=self.dialect.kind)
            self.publisher.start()
        self.runner.start()

    async def stop(self) -> None:
        await self.runner.stop()
        if self.publisher is not None:
            await self.publisher.close()
            self.publisher = None

    # -- helpers -------------------------------------------------------------------------------
    def _new_id(self, prefix: str) -> str:
        return f"{prefix}-{uuid.uuid4().hex[:16]}{next(self._ids)}"

    async def _body(self, request: Request) -> dict[str, Any] | JSONResponse:
        """The request's JSON object for this model, or vLLM's error answer."""
        key = self.settings.api_key
        if key is not None and request.headers.get("authorization") != f"Bearer {key}":
            return JSONResponse({"error": "Unauthorized"}, status_code=401)  # vLLM's --api-key answer
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return self.dialect.error("Invalid JSON body", 400)
        if not isinstance(body, dict):
            return self.dialect.error("Request body must be a JSON object", 400)
        bad = self._check_model(body)
        return bad if bad is not None else body

    def _note_ignored(self, body: dict[str, Any], known: frozenset[str]) -> None:
        extra = sorted(set(body) - known)
        if extra:
            log.warning("The following fields were present in the request but ignored: %s", extra)
            self.ignored_fields = extra

    def _check_model(self, body: dict[str, Any]) -> JSONResponse | None:
        return self.dialect.check_model(body.get("model"), self.settings.model)

    def _max_tokens(self, body: dict[str, Any], prompt_len: int, chat: bool = True) -> int | JSONResponse:
        limit = self.settings.max_model_len
        if prompt_len >= limit:
            return self.dialect.error(self.dialect.too_long(prompt_len, limit, None), 400)
        mt = self.dialect.requested_tokens(body, chat)
        if isinstance(mt, str):
            return self.dialect.error(mt, 400, param="max_tokens")
        if mt is None or mt == 0:
            # No limit asked for (SGLang's chat also reads 0 so): up to the context, as the engines do.
            return limit - prompt_len
        if prompt_len + mt > limit:
            return self.dialect.error(self.dialect.too_long(prompt_len, limit, mt), 400, param="max_tokens")
        return mt

    def _usage(self, req: SimRequest, completion: int) -> dict[str, Any]:
        return self.dialect.usage(req, completion)

    def _request(self, rid: str, prompt: list[int], out_ids: list[int], body: dict[str, Any]) -> SimRequest:
        salt = body.get("cache_salt")
        prio = body.get("priority")
        background = (self.settings.priority_scheduling and isinstance(prio, int) and not isinstance(prio, bool)
                      and self.dialect.is_background(prio))
        return SimRequest(rid, prompt, out_ids, cache_salt=salt if isinstance(salt, str) and salt else None,
                          background=background)

    async def _until_disconnect(self, request: Request, aw: Awaitable[T]) -> T | None:
        """Await ``aw`` unless the client goes away first (then None), as vLLM aborts on disconnect."""
        task = asyncio.ensure_future(aw)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=0.05)
                if done:
                    return task.result()
                if await request.is_disconnected():
                    task.cancel()
                    return None
        finally:
            if not task.done():
                task.cancel()

    async def _collect(self, q: asyncio.Queue[TokenOutput], n: int) -> bool:
        for _ in range(n):
            out = await q.get()
            if out.finished:
                return True
        return True

    # -- endpoints -----------------------------------------------------------------------------
    async def chat(self, request: Request) -> Response:
        body = await self._body(request)
        if isinstance(body, JSONResponse):
            return body
        self._note_ignored(body, _CHAT_FIELDS)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            return self.dialect.error("messages must be a non-empty list of objects", 400, param="messages")
        tools = body.get("tools") if isinstance(body.get("tools"), list) else None
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            return self.dialect.error("chat_template_kwargs must be an object", 400, param="chat_template_kwargs")
        try:
            prompt = self.tokenizer.encode_chat(messages, tools, True, kwargs)
        except TemplateError as exc:
            return self.dialect.error(str(exc), 400, param="messages")
        max_tokens = self._max_tokens(body, len(prompt))
        if isinstance(max_tokens, JSONResponse):
            return max_tokens
        rid = self._new_id("chatcmpl")
        try:
            script = script_for(messages, tools, body.get("sim"), _key(prompt), rid)
        except BadSimSpec as exc:
            return self.dialect.error(str(exc), 400, param="sim")
        thinking = kwargs.get("enable_thinking", True) is not False
        out = RenderedOutput(script, self.tokenizer, thinking, max_tokens)
        req = self._request(rid, prompt, out.token_ids, body)
        created = int(time.time())
        model = self.settings.model
        if body.get("stream"):
            include_usage = _include_usage(body)
            return StreamingResponse(self._stream_chat(req, out, created, model, include_usage),
                                     media_type="text/event-stream")
        self.in_flight += 1
        try:
            q = self.runner.submit(req)
            res = await self._until_disconnect(request, self._collect(q, len(out.token_ids)))
            if res is None and req.generated < len(out.token_ids):
                self.runner.abort(req.id)
                return Response(status_code=499)
        finally:
            self.in_flight -= 1
        return JSONResponse({
            "id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": out.message(), "logprobs": None,
                         "finish_reason": out.finish_reason(), "stop_reason": None}],
            "usage": self._usage(req, len(out.token_ids)),
        })

    async def _stream_chat(self, req: SimRequest, out: RenderedOutput, created: int, model: str,
                           include_usage: bool) -> AsyncIterator[bytes]:
        def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> bytes:
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            choice.update(extra)
            obj = {"id": req.id, "object": "chat.completion.chunk", "created": created, "model": model,
                   "choices": [choice]}
            return b"data: " + json.dumps(obj).encode() + b"\n\n"

        self.in_flight += 1
        q = self.runner.submit(req)
        done = False
        try:
            yield chunk({"role": "assistant", "content": ""})
            k = 0
            while True:
                tok = await q.get()
                d = out.delta(k)
                k += 1
                last = tok.finished
                delta = _delta_json(d)
                if last:
                    yield chunk(delta, out.finish_reason(), stop_reason=None)
                elif delta:
                    yield chunk(delta)
                if last:
                    break
            done = True
            if include_usage:
                usage = {"id": req.id, "object": "chat.completion.chunk", "created": created, "model": model,
                         "choices": [], "usage": self._usage(req, len(out.token_ids))}
                yield b"data: " + json.dumps(usage).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"
        finally:
            self.in_flight -= 1
            if not done:
                self.runner.abort(req.id)

    async def completions(self, request: Request) -> Response:
        body = await self._body(request)
        if isinstance(body, JSONResponse):
            return body
        self._note_ignored(body, _COMPLETION_FIELDS)
        p = body.get("prompt")
        if isinstance(p, str):
            prompt = self.tokenizer.encode(p)
        elif isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            prompt = [int(t) for t in p]
            if any(t < 0 or t >= self.tokenizer.vocab_size for t in prompt):
                return self.dialect.error("prompt token id out of vocabulary", 400, param="prompt")
        else:
            return self.dialect.error("prompt must be a string or a non-empty list of token ids", 400, param="prompt")
        max_tokens = self._max_tokens(body, len(prompt), chat=False)
        if isinstance(max_tokens, JSONResponse):
            return max_tokens
        rid = self._new_id("cmpl")
        raw_spec = body.get("sim")
        spec: dict[str, Any] = dict(raw_spec) if isinstance(raw_spec, dict) else {}
        if body.get("ignore_eos") is True and "answer_tokens" not in spec:
            # vLLM's ignore_eos: generate until max_tokens (benchmarks control output length this way).
            spec["answer_tokens"] = max_tokens
        try:
            script = script_for(None, None, {**spec, "tool_calls": 0}, _key(prompt), rid)
        except BadSimSpec as exc:
            return self.dialect.error(str(exc), 400, param="sim")
        out = RenderedOutput(script, self.tokenizer, False, max_tokens)
        req = self._request(rid, prompt, out.token_ids, body)
        created = int(time.time())
        model = self.settings.model
        if body.get("stream"):
            include_usage = _include_usage(body)
            return StreamingResponse(self._stream_completion(req, out, created, model, include_usage),
                                     media_type="text/event-stream")
        self.in_flight += 1
        try:
            q = self.runner.submit(req)
            res = await self._until_disconnect(request, self._collect(q, len(out.token_ids)))
            if res is None and req.generated < len(out.token_ids):
                self.runner.abort(req.id)
                return Response(status_code=499)
        finally:
            self.in_flight -= 1
        return JSONResponse({
            "id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": out.plain_text(), "logprobs": None,
                         "finish_reason": "length" if out.truncated else "stop", "stop_reason": None,
                         "prompt_logprobs": None}],
            "usage": self._usage(req, len(out.token_ids)),
        })

    async def _stream_completion(self, req: SimRequest, out: RenderedOutput, created: int, model: str,
                                 include_usage: bool) -> AsyncIterator[bytes]:
        def chunk(text: str, finish: str | None) -> bytes:
            obj = {"id": req.id, "object": "text_completion", "created": created, "model": model,
                   "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish,
                                "stop_reason": None}]}
            return b"data: " + json.dumps(obj).encode() + b"\n\n"

        self.in_flight += 1
        q = self.runner.submit(req)
        done = False
        try:
            k = 0
            while True:
                tok = await q.get()
                d = out.delta(k)
                k += 1
                finish = ("length" if out.truncated else "stop") if tok.finished else None
                yield chunk(d.content, finish)
                if tok.finished:
                    break
            done = True
            if include_usage:
                usage = {"id": req.id, "object": "text_completion", "created": created, "model": model,
                         "choices": [], "usage": self._usage(req, len(out.token_ids))}
                yield b"data: " + json.dumps(usage).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"
        finally:
            self.in_flight -= 1
            if not done:
                self.runner.abort(req.id)

    async def tokenize(self, request: Request) -> Response:
        body = await self._body(request)
        if isinstance(body, JSONResponse):
            return body
        try:
            if isinstance(body.get("messages"), list):
                ids = self.tokenizer.encode_chat(
                    body["messages"], body.get("tools"), bool(body.get("add_generation_prompt", True)),
                    body.get("chat_template_kwargs") or {})
            elif isinstance(body.get("prompt"), str):
                ids = self.tokenizer.encode(body["prompt"], bool(body.get("add_special_tokens", True)))
            else:
                return self.dialect.error("either prompt or messages is required", 400)
        except TemplateError as exc:
            return self.dialect.error(str(exc), 400, param="messages")
        return JSONResponse({"count": len(ids), "max_model_len": self.settings.max_model_len,
                             "tokens": ids, "token_strs": None})

    async def detokenize(self, request: Request) -> Response:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return self.dialect.error("Invalid JSON body", 400)
        toks = body.get("tokens") if isinstance(body, dict) else None
        if not isinstance(toks, list) or not all(isinstance(t, int) for t in toks):
            return self.dialect.error("tokens must be a list of integers", 400, param="tokens")
        return JSONResponse({"prompt": self.tokenizer.decode(toks)})

    def build_app(self) -> FastAPI:
        @asynccontextmanager
        async def lifespan(app: FastAPI) -> AsyncIterator[None]:
            await self.start()
            try:
                yield
            finally:
                await self.stop()

        app = FastAPI(title=f"kvgate simulated {self.settings.engine} worker", lifespan=lifespan)
        registry = CollectorRegistry()
        registry.register(self.dialect.collector(self.core, self.settings.model, lambda: self.runner.aborted,
                                                 lambda: self.started_at))
        app.add_api_route("/v1/chat/completions", self.chat, methods=["POST"])
        app.add_api_route("/v1/completions", self.completions, methods=["POST"])
        app.add_api_route("/tokenize", self.tokenize, methods=["POST"])
        app.add_api_route("/detokenize", self.detokenize, methods=["POST"])

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            return {"object": "list", "data": [{
                "id": self.settings.model, "object": "model", "created": int(time.time()),
                "owned_by": self.dialect.owned_by, "root": str(self.model_dir), "parent": None,
                "max_model_len": self.settings.max_model_len}]}

        @app.get("/health")
        async def health() -> Response:
            return Response(status_code=200)

        @app.get("/load")
        async def load() -> dict[str, int]:
            return {"server_load": self.in_flight}

        @app.get("/metrics")
        async def metrics() -> Response:
            return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

        async def reset() -> Response:
            return self.dialect.reset_response(self.core.reset_prefix_cache())

        app.add_api_route(self.dialect.reset_path, reset, methods=list(self.dialect.reset_methods))

        @app.get("/kv_event_sources")
        async def kv_event_sources() -> dict[str, Any]:
            # kvgate's discovery hook: where this worker publishes KV events, with its hashing setup.
            s = self.settings
            return {"endpoint": s.kv_events_endpoint, "replay_endpoint": s.kv_replay_endpoint,
                    "topic": s.kv_events_topic, "block_size": self.profile.block_size,
                    "hash_algo": s.hash_algo, "engine": s.engine}

        if self.dialect.server_info:
            app.add_api_route("/server_info", self.server_info, methods=["GET"])
        return app

    async def server_info(self) -> dict[str, Any]:
        """The part of SGLang's ``/server_info`` a KV-aware router reads (``describe_kv_events_publisher``)."""
        s = self.settings
        info: dict[str, Any] = {"page_size": self.profile.block_size, "served_model_name": s.model,
                                "context_length": s.max_model_len, "enable_cache_report": s.enable_cache_report}
        ep = s.kv_events_endpoint
        if ep and ep.startswith("tcp://"):
            host, _, port = ep[len("tcp://"):].rpartition(":")
            kv: dict[str, Any] = {"publisher": "zmq", "endpoint_host": host, "endpoint_port_base": int(port),
                                  "topic": s.kv_events_topic, "block_size": self.profile.block_size, "dp_size": 1}
            if s.kv_replay_endpoint and s.kv_replay_endpoint.startswith("tcp://"):
                kv["replay_endpoint_port_base"] = int(s.kv_replay_endpoint.rpartition(":")[2])
            info["kv_events"] = kv
        return info


def _include_usage(body: dict[str, Any]) -> bool:
    # vLLM: a stream carries a usage chunk when stream_options is given and include_usage is not false.
    opts = body.get("stream_options")
    return bool(opts.get("include_usage", True)) if isinstance(opts, dict) and opts else False


def _delta_json(d: Delta) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if d.reasoning:
        out["reasoning"] = d.reasoning
    if d.content:
        out["content"] = d.content
    if d.tool_calls:
        out["tool_calls"] = [{"index": i, **tool_call_json(c)} for i, c in d.tool_calls]
    return out


def _key(prompt: list[int]) -> bytes:
    return hashlib.blake2b(json.dumps(prompt).encode(), digest_size=16).digest()


