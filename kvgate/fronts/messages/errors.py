"""Errors in Anthropic's shape: ``{"type": "error", "error": {"type": ..., "message": ...}}``.

The type follows the status, as Anthropic's does; kvgate's own statuses keep their meaning: its 503 (no
healthy worker, a full fleet) is ``overloaded_error`` and its 429 (a tenant's quota) ``rate_limit_error``,
which the Anthropic SDKs retry after ``retry-after`` as they would Anthropic's own.
"""

from __future__ import annotations

from typing import Any

from kvgate.errors import ApiError

_BY_STATUS = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
              404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
              503: "overloaded_error", 529: "overloaded_error"}


def error_type(status: int) -> str:
    return _BY_STATUS.get(status) or ("api_error" if status >= 500 else "invalid_request_error")


def error_body(status: int, err: ApiError | dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"type": error_type(status), "message": _message(status, err)}
    if isinstance(err, ApiError) and err.code == "thread_unsupported_request":
        # What the SDK's message threads read to fall back to the full history (anthropic lib/threads).
        out["details"] = {"error_code": err.code, "unsupported": [err.param or "thread"]}
    return {"type": "error", "error": out}


def _message(status: int, err: ApiError | dict[str, Any]) -> str:
    if isinstance(err, ApiError):
        return err.message
    inner = err.get("error")
    for d in (inner, err):  # OpenAI's {"error": {...}}, vLLM's older {"object": "error", "message": ...}
        if isinstance(d, dict) and isinstance(d.get("message"), str):
            return str(d["message"])
    if isinstance(inner, str):
        return inner
    return f"the worker answered {status}"
