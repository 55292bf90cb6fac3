"""What differs between vLLM's and SGLang's OpenAI servers, for the simulated worker: error bodies, the
``usage`` object, token limits, priorities, the cache-flush endpoint and the metric names.

SGLang facts from 0.5.23's source: ``entrypoints/openai/serving_base.py`` (``create_error_response``: a
flat ``{"object": "error", ...}``), ``usage_processor.py`` (``prompt_tokens_details`` only with
``--enable-cache-report``, then always, zero included), ``protocol.py`` (chat ``max_tokens`` 0 or absent
means no limit; completions need ``max_tokens`` >= 1), ``managers/tokenizer_manager.py`` (context-length
messages), ``http_server.py`` (``/flush_cache``: 200 or 400 when requests are in flight; the ``model``
field is not checked), ``schedule_policy.py`` (higher ``priority`` runs first).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client.registry import Collector

from kvgate.sim.engine import EngineCore, SimRequest
from kvgate.sim.kinds import SGLANG, VLLM, EngineKind
from kvgate.sim.metrics import EngineCollector, SglangCollector


class VllmDialect:
    kind: EngineKind = VLLM
    owned_by = "vllm"
    reset_path = "/reset_prefix_cache"
    reset_methods: tuple[str, ...] = ("POST",)
    server_info = False
    """SGLang's ``/server_info`` (with the KV-event descriptor routers read)."""

    def __init__(self, cache_report: bool = True) -> None:
        self.cache_report = cache_report

    def error(self, message: str, status: int, type_: str = "BadRequestError", param: str | None = None
              ) -> JSONResponse:
        # OpenAI's shape with the HTTP status as the code.
        return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": status}},
                            status_code=status)

    def check_model(self, model: object, served: str) -> JSONResponse | None:
        if model is not None and model != served:
            return self.error(f"The model `{model}` does not exist.", 404, "NotFoundError", "model")
        return None

    def requested_tokens(self, body: dict[str, Any], chat: bool) -> int | str | None:
        """The completion limit asked for, None for the default, or an error message."""
        mt = body.get("max_completion_tokens", body.get("max_tokens")) if chat else body.get("max_tokens", 16)
        if mt is None:
            return None
        if not isinstance(mt, int) or isinstance(mt, bool) or mt < 1:
            return "max_tokens must be a positive integer"
        return mt

    def too_long(self, prompt_len: int, limit: int, mt: int | None) -> str:
        if mt is None:
            return (f"This model's maximum context length is {limit} tokens. However, your request has "
                    f"{prompt_len} input tokens. Please reduce the length of the input messages.")
        return (f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_len + mt} tokens ({prompt_len} in the messages, {mt} in the completion).")

    def usage(self, req: SimRequest, completion: int) -> dict[str, Any]:
        return {"prompt_tokens": len(req.prompt), "total_tokens": len(req.prompt) + completion,
                "completion_tokens": completion,
                # vLLM 0.32 with --enable-prompt-tokens-details always reports them, zero included.
                "prompt_tokens_details": {"cached_tokens": max(0, req.num_cached_tokens)}}

    def is_background(self, priority: int) -> bool:
        return priority > 0  # vLLM: lower values first, 0 by default

    def collector(self, core: EngineCore, model: str, aborted: Callable[[], int],
                  started_at: Callable[[], float]) -> Collector:
        return EngineCollector(core, model, aborted, started_at)

    def reset_response(self, ok: bool) -> Response:
        return Response(status_code=200 if ok else 409)


class SglangDialect(VllmDialect):
    kind = SGLANG
    owned_by = "sglang"
    reset_path = "/flush_cache"
    reset_methods = ("GET", "POST")
    server_info = True

    def error(self, message: str, status: int, type_: str = "BadRequestError", param: str | None = None
              ) -> JSONResponse:
        return JSONResponse({"object": "error", "message": message, "type": type_, "param": param,
                             "code": status}, status_code=status)

    def check_model(self, model: object, served: str) -> JSONResponse | None:
        return None  # SGLang serves whatever the request names

    def requested_tokens(self, body: dict[str, Any], chat: bool) -> int | str | None:
        if not chat:
            mt = body.get("max_tokens", 16)
            if mt is None:
                return None
            if not isinstance(mt, int) or isinstance(mt, bool) or mt <= 0:
                return ("1 validation error for CompletionRequest\nmax_tokens\n"
                        "  Value error, max_tokens must be positive")
            return mt
        mt = body.get("max_completion_tokens") or body.get("max_tokens")  # 0 falls through, as in SGLang
        if mt is None:
            return None
        if not isinstance(mt, int) or isinstance(mt, bool) or mt < 0:
            return f"max_new_tokens must be at least 0, got {mt}."
        return mt

    def too_long(self, prompt_len: int, limit: int, mt: int | None) -> str:
        if mt is None:
            return f"The input ({prompt_len} tokens) is longer than the model's context length ({limit} tokens)."
        return (f"Requested token count exceeds the model's maximum context length of {limit} tokens. You "
                f"requested a total of {prompt_len + mt} tokens: {prompt_len} tokens from the input messages "
                f"and {mt} tokens for the completion. Please reduce the number of tokens in the input "
                f"messages or the completion to fit within the limit.")

    def usage(self, req: SimRequest, completion: int) -> dict[str, Any]:
        details = {"cached_tokens": max(0, req.num_cached_tokens)} if self.cache_report else None
        return {"prompt_tokens": len(req.prompt), "total_tokens": len(req.prompt) + completion,
                "completion_tokens": completion, "prompt_tokens_details": details, "reasoning_tokens": 0,
                "completion_tokens_details": None}

    def is_background(self, priority: int) -> bool:
        return priority < 0  # SGLang: higher values first

    def collector(self, core: EngineCore, model: str, aborted: Callable[[], int],
                  started_at: Callable[[], float]) -> Collector:
        return SglangCollector(core, model, aborted, started_at)

    def reset_response(self, ok: bool) -> Response:
        if ok:
            return PlainTextResponse("Cache flushed.\nPlease check backend logs for more details. (When there "
                                     "are running or waiting requests, the operation will not be performed.)\n")
        return PlainTextResponse("Flush cache failed.\n", status_code=400)


def dialect_for(engine: str, cache_report: bool = True) -> VllmDialect:
    return {"vllm": VllmDialect, "sglang": SglangDialect}[engine](cache_report)
