"""What Envoy's ext_proc filter sends an endpoint picker, message by message, and how it applies the
answers, built from the vendored ext_proc v3 protos (no Envoy can run here). ``Envoy`` below is the
test's data plane: it asks the picker for each request exactly in the order Envoy does in
FULL_DUPLEX_STREAMED mode (headers, body chunks, end of stream; then response headers and body chunks)
and forwards to the picked endpoint as override-host load balancing would (the first endpoint of
``envoy.lb`` / ``x-gateway-destination-endpoint``, the next ones on a connection failure)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping
from typing import Any

import grpc
import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from google.protobuf import struct_pb2

from kvgate.epp import protocol as proto
from kvgate.grpc.gen.envoy.config.core.v3 import base_pb2 as core
from kvgate.grpc.gen.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from kvgate.grpc.gen.envoy.service.ext_proc.v3 import external_processor_pb2_grpc as epgrpc

HOP = {"host", "connection", "content-length", "transfer-encoding", "keep-alive"}


def header_map(items: Mapping[str, str]) -> core.HeaderMap:
    return core.HeaderMap(headers=[core.HeaderValue(key=k.lower(), raw_value=v.encode()) for k, v in items.items()])


def request_headers(path: str, headers: Mapping[str, str], end_of_stream: bool = False, method: str = "POST",
                    subset: list[str] | None = None, config: ep.ProtocolConfiguration | None = None
                    ) -> ep.ProcessingRequest:
    hs = {":method": method, ":path": path, ":authority": "gateway.example", ":scheme": "http", **headers}
    req = ep.ProcessingRequest(request_headers=ep.HttpHeaders(headers=header_map(hs), end_of_stream=end_of_stream))
    if subset is not None:
        s = struct_pb2.Struct()
        s.get_or_create_list(proto.SUBSET).extend(subset)
        req.metadata_context.filter_metadata[proto.SUBSET_NS].CopyFrom(s)
    if config is not None:
        req.protocol_config.CopyFrom(config)
    return req


def request_body(data: bytes, end_of_stream: bool) -> ep.ProcessingRequest:
    return ep.ProcessingRequest(request_body=ep.HttpBody(body=data, end_of_stream=end_of_stream))


def response_headers(status: int, headers: Mapping[str, str], served: str | None = None,
                     end_of_stream: bool = False) -> ep.ProcessingRequest:
    req = ep.ProcessingRequest(response_headers=ep.HttpHeaders(
        headers=header_map({":status": str(status), **headers}), end_of_stream=end_of_stream))
    if served is not None:
        s = struct_pb2.Struct()
        s[proto.SERVED] = served
        req.metadata_context.filter_metadata[proto.DESTINATION_NS].CopyFrom(s)
    return req


def response_body(data: bytes, end_of_stream: bool) -> ep.ProcessingRequest:
    return ep.ProcessingRequest(response_body=ep.HttpBody(body=data, end_of_stream=end_of_stream))


def apply(headers: dict[str, str], m: ep.HeaderMutation) -> None:
    """Envoy's header mutation: set (overwrite or append, as each option says), then remove."""
    for o in m.set_headers:
        k, v = o.header.key.lower(), (o.header.raw_value or o.header.value.encode()).decode()
        if o.append_action == core.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD or k not in headers:
            headers[k] = v
        else:
            headers[k] = f"{headers[k]},{v}"
    for k in m.remove_headers:
        headers.pop(k.lower(), None)


def destination(resp: ep.ProcessingResponse) -> str:
    return resp.dynamic_metadata.fields[proto.DESTINATION_NS].struct_value.fields[proto.DESTINATION].string_value


def split(data: bytes, parts: int) -> list[bytes]:
    n = max(1, -(-len(data) // parts))
    return [data[i:i + n] for i in range(0, len(data), n)] or [b""]


class Envoy:
    """A FULL_DUPLEX_STREAMED ext_proc data plane with override-host routing, as an HTTP server."""

    def __init__(self, epp_target: str, chunks: int = 3, metadata: tuple[tuple[str, str], ...] = ()) -> None:
        self.channel = grpc.aio.insecure_channel(epp_target)
        self.metadata = metadata
        """What Envoy's ext_proc ``grpc_service.initial_metadata`` sends on every stream."""
        self.stub = epgrpc.ExternalProcessorStub(self.channel)
        self.client = httpx.AsyncClient(timeout=60)
        self.chunks = chunks
        self.picks: list[str] = []
        self.app = FastAPI()
        self.app.add_api_route("/{path:path}", self.handle, methods=["GET", "POST"])

    async def close(self) -> None:
        await self.client.aclose()
        await self.channel.close()

    async def handle(self, request: Request) -> Response:
        body = await request.body()
        headers = {k: v for k, v in request.headers.items() if k not in HOP}
        headers["content-length"] = str(len(body))
        call = self.stub.Process(metadata=self.metadata)
        await call.write(request_headers("/" + request.path_params["path"], headers, end_of_stream=not body,
                                         method=request.method))
        for i, part in enumerate(split(body, self.chunks) if body else []):
            await call.write(request_body(part, end_of_stream=i == len(split(body, self.chunks)) - 1))
        first: Any = await call.read()
        if first.HasField("immediate_response"):
            ir = first.immediate_response
            out = {h.header.key: h.header.raw_value.decode() for h in ir.headers.set_headers}
            await call.done_writing()
            return Response(ir.body, status_code=ir.status.code, headers=out)
        apply(headers, first.request_headers.response.header_mutation)
        endpoints = destination(first)
        assert endpoints == headers[proto.DESTINATION], "header and metadata must name the same endpoints"
        new_body = b""
        while body:
            r: Any = await call.read()
            sr = r.request_body.response.body_mutation.streamed_response
            new_body += sr.body
            if sr.end_of_stream:
                break
        self.picks.append(endpoints)
        return await self._upstream(call, request.method, "/" + request.path_params["path"], headers, new_body,
                                    endpoints.split(","))

    async def _upstream(self, call: Any, method: str, path: str, headers: dict[str, str], body: bytes,
                        endpoints: list[str]) -> Response:
        upstream = None
        for served in endpoints:  # override host, then the fallbacks in order on a connection failure
            try:
                upstream = await self.client.send(self.client.build_request(
                    method, f"http://{served}{path}", content=body or None,
                    headers={k: v for k, v in headers.items() if not k.startswith(":")}), stream=True)
                break
            except httpx.ConnectError:
                continue
        assert upstream is not None
        rh = dict(upstream.headers)
        for k in ("content-length", "transfer-encoding", "connection"):
            rh.pop(k, None)  # FULL_DUPLEX_STREAMED: Envoy drops content-length, the body may change
        await call.write(response_headers(upstream.status_code, rh, served=served))
        hr: Any = await call.read()
        apply(rh, hr.response_headers.response.header_mutation)
        return StreamingResponse(self._relay(call, upstream), status_code=upstream.status_code, headers=rh)

    async def _relay(self, call: Any, upstream: httpx.Response) -> AsyncIterator[bytes]:
        out: asyncio.Queue[bytes | None] = asyncio.Queue()

        async def read() -> None:
            while True:
                r: Any = await call.read()
                if r is grpc.aio.EOF:
                    break
                sr = r.response_body.response.body_mutation.streamed_response
                await out.put(sr.body)
                if sr.end_of_stream:
                    break
            await out.put(None)

        async def write() -> None:
            async for chunk in upstream.aiter_raw():
                await call.write(response_body(chunk, False))
            await call.write(response_body(b"", True))

        reader = asyncio.ensure_future(read())
        writer = asyncio.ensure_future(write())
        try:
            while (chunk := await out.get()) is not None:
                if chunk:
                    yield chunk
            await writer
            await call.done_writing()
        finally:
            for t in (reader, writer):
                t.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t
            await upstream.aclose()
