"""Requests whose bytes are not their message, answered INVALID_ARGUMENT.

grpc.aio parses a request before any interceptor's handler or servicer runs, and a ``DecodeError`` there
(truncated bytes, invalid UTF-8 in a string field, an 11-byte varint, groups nested past the parser's
limit) is an unhandled servicer error: logged with a traceback and answered UNKNOWN, gRPC's 500, to
anyone who can reach the port (the auth hook cannot run first: it refuses through a handler that
parses the same bytes). ``MalformedGuard`` gives every method a parser that returns a ``Malformed``
marker instead of raising, and a handler that answers the marker INVALID_ARGUMENT
(``kvgate-error-code: malformed_message``). Streaming requests are checked message by message as the
servicer reads them through its request iterator (a servicer that calls ``context.read()`` would get
the marker itself: none here does).

Placed after the auth hook, so a caller without credentials is told UNAUTHENTICATED whatever it sent.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from typing import Any, NoReturn

import grpc
from google.protobuf.message import DecodeError

from kvgate.grpc.status import bounded

Handler = Any
"""A ``grpc.RpcMethodHandler`` (its stubs are not generic over what the guard wraps)."""


class Malformed:
    """What the guarded parser returns for bytes that do not parse."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _tolerant(parse: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def guarded(data: bytes) -> Any:
        try:
            return parse(data)
        except DecodeError as exc:
            return Malformed(str(exc))

    return guarded


async def _refuse(context: grpc.aio.ServicerContext[Any, Any], m: Malformed) -> NoReturn:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, bounded(f"malformed request message: {m.reason}"),
                        (("kvgate-error-code", "malformed_message"),))


async def _checked(requests: AsyncIterable[Any], context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
    async for r in requests:
        if isinstance(r, Malformed):
            await _refuse(context, r)
        yield r


def _guard(handler: Handler) -> Handler:
    parse, ser = _tolerant(handler.request_deserializer), handler.response_serializer
    if handler.unary_unary is not None:
        uu = handler.unary_unary

        async def unary_unary(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            if isinstance(request, Malformed):
                await _refuse(context, request)
            out = uu(request, context)
            return await out if inspect.isawaitable(out) else out

        return grpc.unary_unary_rpc_method_handler(unary_unary, parse, ser)
    if handler.unary_stream is not None:
        us = handler.unary_stream
        # The same kind as the servicer's: an async generator yields its answers, a coroutine writes them
        # with context.write() (the health service's Watch), and grpc.aio drives each kind its own way.
        if inspect.isasyncgenfunction(us):
            async def unary_stream_gen(request: Any, context: grpc.aio.ServicerContext[Any, Any]
                                       ) -> AsyncIterator[Any]:
                if isinstance(request, Malformed):
                    await _refuse(context, request)
                async for r in us(request, context):
                    yield r

            return grpc.unary_stream_rpc_method_handler(unary_stream_gen, parse, ser)

        async def unary_stream(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
            if isinstance(request, Malformed):
                await _refuse(context, request)
            await us(request, context)

        return grpc.unary_stream_rpc_method_handler(unary_stream, parse, ser)
    if handler.stream_unary is not None:
        su = handler.stream_unary

        async def stream_unary(requests: AsyncIterable[Any], context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            out = su(_checked(requests, context), context)
            return await out if inspect.isawaitable(out) else out

        return grpc.stream_unary_rpc_method_handler(stream_unary, parse, ser)
    ss = handler.stream_stream
    if inspect.isasyncgenfunction(ss):
        async def stream_stream_gen(requests: AsyncIterable[Any], context: grpc.aio.ServicerContext[Any, Any]
                                    ) -> AsyncIterator[Any]:
            async for r in ss(_checked(requests, context), context):
                yield r

        return grpc.stream_stream_rpc_method_handler(stream_stream_gen, parse, ser)

    async def stream_stream(requests: AsyncIterable[Any], context: grpc.aio.ServicerContext[Any, Any]) -> None:
        await ss(_checked(requests, context), context)

    return grpc.stream_stream_rpc_method_handler(stream_stream, parse, ser)


class MalformedGuard(grpc.aio.ServerInterceptor):
    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler | None]],
                                details: grpc.HandlerCallDetails) -> Handler | None:
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler  # an unknown method (UNIMPLEMENTED), or one that takes raw bytes
        return _guard(handler)
