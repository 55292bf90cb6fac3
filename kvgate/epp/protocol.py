"""Envoy's ext_proc v3 messages as the Gateway API Inference Extension's endpoint picker protocol uses them
(``docs/proposals/004-endpoint-picker-protocol`` in kubernetes-sigs/gateway-api-inference-extension):

- request: Envoy MAY name the endpoints the picker must choose from in the request's filter metadata,
  ``envoy.lb.subset_hint`` / ``x-gateway-destination-endpoint-subset`` (a list of ``ip:port``); an empty
  list or one with no eligible endpoint is answered with an ImmediateResponse 503;
- the pick: the ``x-gateway-destination-endpoint`` request header AND the response's dynamic metadata
  ``envoy.lb`` / ``x-gateway-destination-endpoint`` (what Envoy's override-host load balancing reads),
  one value for both: ``ip:port`` or ``ip:port,ip:port,...`` (fallbacks for Envoy's retries, in order);
  no ready endpoint: ImmediateResponse 503; a request to drop: 429;
- response: Envoy reports the endpoint that served in the metadata ``envoy.lb`` /
  ``x-gateway-destination-endpoint-served`` (it may be a fallback).
"""

from __future__ import annotations

from collections.abc import Mapping

from google.protobuf import struct_pb2

from kvgate.grpc.gen.envoy.config.core.v3 import base_pb2 as core
from kvgate.grpc.gen.envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as pm
from kvgate.grpc.gen.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from kvgate.grpc.gen.envoy.type.v3 import http_status_pb2 as hs

DESTINATION_NS = "envoy.lb"
DESTINATION = "x-gateway-destination-endpoint"
SERVED = "x-gateway-destination-endpoint-served"
SUBSET_NS = "envoy.lb.subset_hint"
SUBSET = "x-gateway-destination-endpoint-subset"
CHUNK = 62_000
"""Largest body chunk sent back in FULL_DUPLEX_STREAMED mode: Envoy recommends at most 64 KiB per
response; the reference picker keeps a margin below that, and so does kvgate."""

FULL_DUPLEX = pm.ProcessingMode.FULL_DUPLEX_STREAMED
BUFFERED = pm.ProcessingMode.BUFFERED
BodyMode = pm.ProcessingMode.BodySendMode.ValueType


def headers_of(hm: core.HeaderMap) -> dict[str, str]:
    """Header names lower-cased (Envoy sends them so), values from ``raw_value`` (Envoy's encoding) or
    ``value``; repeated names joined with ", " as HTTP folds them."""
    # Joined once per name: folding one value at a time copies the whole line each time, and 250,000
    # repeats of one name (a 2 MiB message) then held the event loop for over a second.
    parts: dict[str, list[str]] = {}
    for h in hm.headers:
        v = h.raw_value.decode("utf-8", errors="replace") if h.raw_value else h.value
        parts.setdefault(h.key.lower(), []).append(v)
    return {k: ", ".join(vs) for k, vs in parts.items()}


def unsigned(text: str) -> int | None:
    """A header's unsigned decimal value (``content-length``, ``:status``), or None when it is not one.
    ASCII digits only: ``str.isdigit`` also takes "²", which ``int`` refuses, and other scripts' digits;
    more than 18 digits is read as larger than any limit (``int`` refuses past 4,300 of them)."""
    if not (text.isascii() and text.isdigit()):
        return None
    return int(text) if len(text) <= 18 else 1 << 62


def set_headers(items: Mapping[str, str]) -> list[core.HeaderValueOption]:
    """Header mutations that replace any value present (Envoy's default action appends)."""
    return [core.HeaderValueOption(header=core.HeaderValue(key=k, raw_value=v.encode()),
                                   append_action=core.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD)
            for k, v in items.items()]


def destination_metadata(endpoints: str) -> struct_pb2.Struct:
    md = struct_pb2.Struct()
    md.get_or_create_struct(DESTINATION_NS)[DESTINATION] = endpoints
    return md


def _filter_metadata(req: ep.ProcessingRequest, ns: str) -> struct_pb2.Struct | None:
    fm = req.metadata_context.filter_metadata
    return fm[ns] if ns in fm else None


def subset_of(req: ep.ProcessingRequest) -> list[str] | None:
    """The endpoint subset Envoy allows, or None when it names none (then the whole pool is allowed)."""
    ns = _filter_metadata(req, SUBSET_NS)
    if ns is None or SUBSET not in ns.fields:
        return None
    value = ns.fields[SUBSET]
    if value.WhichOneof("kind") != "list_value":
        return None  # not the protocol's shape: as if absent, like the reference picker
    return [v.string_value for v in value.list_value.values if v.WhichOneof("kind") == "string_value"]


def served_of(req: ep.ProcessingRequest) -> str | None:
    ns = _filter_metadata(req, DESTINATION_NS)
    if ns is None or SERVED not in ns.fields:
        return None
    v = ns.fields[SERVED]
    return v.string_value if v.WhichOneof("kind") == "string_value" else None


def immediate(status: int, body: bytes, headers: Mapping[str, str], details: str) -> ep.ProcessingResponse:
    """A local reply Envoy sends to the client instead of forwarding the request."""
    return ep.ProcessingResponse(immediate_response=ep.ImmediateResponse(
        status=hs.HttpStatus(code=status),  # type: ignore[arg-type]  # any HTTP code; the enum only names some
        headers=ep.HeaderMutation(set_headers=set_headers(headers)), body=body, details=details))


def streamed(body: bytes, end_of_stream: bool) -> list[ep.CommonResponse]:
    """``body`` as FULL_DUPLEX_STREAMED body mutations of at most ``CHUNK`` bytes each; ``end_of_stream``
    on the last one. An empty body is one empty chunk (it may carry the end of the stream)."""
    parts = [body[i:i + CHUNK] for i in range(0, len(body), CHUNK)] or [b""]
    return [ep.CommonResponse(body_mutation=ep.BodyMutation(streamed_response=ep.StreamedBodyResponse(
        body=part, end_of_stream=end_of_stream and i == len(parts) - 1))) for i, part in enumerate(parts)]
