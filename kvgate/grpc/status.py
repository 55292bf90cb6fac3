"""kvgate's errors as gRPC status codes. The OpenAI-style code and parameter of an ``ApiError`` travel in
the trailing metadata (``kvgate-error-code``, ``kvgate-error-param``), so a client can tell
``model_not_found`` from ``response_not_found`` as it can over HTTP."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any, NoReturn, TypeVar

import grpc

from kvgate.errors import ApiError
from kvgate.kvstore.conversations import StoreError

T = TypeVar("T")

MAX_DETAILS = 1024
"""UTF-8 bytes of a status message. Details travel in the trailers (``grpc-message``, percent-encoded: up
to 3 characters a byte) and a client refuses trailers over 8-16 KiB: an error that echoes a client's
600 KB conversation id would reach that client as RESOURCE_EXHAUSTED ("received metadata size exceeds
hard limit") instead of the NOT_FOUND it is."""

CODES: dict[int, grpc.StatusCode] = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    404: grpc.StatusCode.NOT_FOUND,
    409: grpc.StatusCode.FAILED_PRECONDITION,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    422: grpc.StatusCode.INVALID_ARGUMENT,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    502: grpc.StatusCode.UNAVAILABLE,
    503: grpc.StatusCode.UNAVAILABLE,
}


def bounded(text: str, limit: int = MAX_DETAILS) -> str:
    """``text`` cut to ``limit`` UTF-8 bytes (at a character boundary), marked as cut."""
    data = text.encode("utf-8", "replace")
    return text if len(data) <= limit else data[:limit - 3].decode("utf-8", "ignore") + "..."


async def abort(context: grpc.aio.ServicerContext[Any, Any], exc: ApiError) -> NoReturn:
    trailing = (("kvgate-error-code", str(exc.code or "")), ("kvgate-error-param", bounded(exc.param or "", 256)))
    await context.abort(CODES.get(exc.status, grpc.StatusCode.INTERNAL), bounded(exc.message), trailing)


async def answer(context: grpc.aio.ServicerContext[Any, Any], aw: Awaitable[T]) -> T:
    """``aw``'s result, or the call ended with the status its error maps to."""
    try:
        return await aw
    except ApiError as exc:
        await abort(context, exc)
    except StoreError as exc:
        await context.abort(grpc.StatusCode.UNAVAILABLE, bounded(f"conversation store: {exc}"),
                            (("kvgate-error-code", "session_store_unavailable"),))
