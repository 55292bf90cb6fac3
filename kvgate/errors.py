"""Errors kvgate answers with, all in OpenAI's shape ``{"error": {message, type, param, code}}``.

Hierarchy::

    ApiError                       an answer to the client, with its HTTP status
    ├── BadRequest           400   malformed JSON, wrong field types, bad values
    ├── UnprocessableEntity  422   well-formed JSON missing what the endpoint needs
    ├── NotFound             404   unknown model or conversation
    ├── Conflict             409   history inconsistent with the stored conversation
    ├── PayloadTooLarge      413   body over the configured limit
    ├── BadGateway           502   the worker was lost while it had the request
    └── ServiceUnavailable   503   no healthy worker (with Retry-After)

Adapters translate library errors into these, chained with ``from exc``.
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse


class ApiError(Exception):
    status = 500
    type = "InternalServerError"

    def __init__(self, message: str, param: str | None = None, code: str | int | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


class BadRequest(ApiError):
    status = 400
    type = "invalid_request_error"


class UnprocessableEntity(ApiError):
    status = 422
    type = "invalid_request_error"


class NotFound(ApiError):
    status = 404
    type = "not_found_error"


class Conflict(ApiError):
    status = 409
    type = "conflict_error"


class PayloadTooLarge(ApiError):
    status = 413
    type = "invalid_request_error"


class BadGateway(ApiError):
    status = 502
    type = "upstream_error"


class ServiceUnavailable(ApiError):
    status = 503
    type = "service_unavailable"


def error_body(message: str, type_: str, param: str | None = None, code: str | int | None = None
               ) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
