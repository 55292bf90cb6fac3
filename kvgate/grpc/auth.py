"""Authentication and roles of the gRPC control API, over the HTTP front's ``Authenticator``
(kvgate/gateway/auth.py): the same API keys and JWTs, sent as ``authorization: Bearer ...`` or
``x-api-key`` metadata. With auth off everyone is ``anonymous@<peer>`` with every role, as before.
With auth on the control API is an operator's: an operator holds READ and OPERATE; a tenant holds
neither (the API reads every tenant's conversations and decisions, so it has no tenant view).

Every call passes ``AuthInterceptor``: it reads the call's metadata (``authorization: Bearer ...``,
``x-api-key``, ...), asks ``authenticate`` who is calling, and ``authorize`` whether that principal
holds the role ``ROLES`` requires for the method. A refusal ends the call with UNAUTHENTICATED (no or
bad credentials) or PERMISSION_DENIED (a role missing) before the service runs. Handlers that record
who did something (``Policy.UpdatePolicy``) name the caller with ``principal_of``.

Health and reflection stay open (probes and tooling carry no credentials).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import grpc

from kvgate.errors import ApiError
from kvgate.gateway.auth import Authenticator
from kvgate.grpc.status import bounded

READ = "read"
"""Reading state: conversations, workers, policy, routing explanations and the decision stream."""
OPERATE = "operate"
"""Changing state: the cost model's parameters."""

ROLES: dict[str, str] = {
    "/kvgate.v1.Routing/Explain": READ,
    "/kvgate.v1.Routing/WatchDecisions": READ,
    "/kvgate.v1.Conversations/GetConversation": READ,
    "/kvgate.v1.Conversations/GetNextPrefix": READ,
    "/kvgate.v1.Policy/GetPolicy": READ,
    "/kvgate.v1.Policy/ListPolicyChanges": READ,
    "/kvgate.v1.Policy/UpdatePolicy": OPERATE,
    "/kvgate.v1.Fleet/ListWorkers": READ,
}
"""The role each method needs. A kvgate.v1 method missing here is refused (a new method must be given
a role deliberately)."""
OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.v1alpha.ServerReflection/",
                 "/grpc.reflection.v1.ServerReflection/")


@dataclass(frozen=True, slots=True)
class Principal:
    name: str
    roles: frozenset[str] = field(default_factory=frozenset)


def authenticate(metadata: Mapping[str, str], peer: str = "", auth: Authenticator | None = None
                 ) -> Principal | None:
    """Who is calling, from the call's metadata; None refuses the call (UNAUTHENTICATED)."""
    host = peer.split(":", 1)[1] if peer.startswith(("ipv4:", "ipv6:")) else peer
    if auth is None or not auth.settings.enabled:
        return Principal(f"anonymous@{host or 'unknown'}", frozenset({READ, OPERATE}))
    try:
        who = auth.authenticate({k.lower(): v for k, v in metadata.items()})
    except ApiError:
        return None
    roles = frozenset({READ, OPERATE}) if who.operator else frozenset()
    return Principal(f"{who.name}@{host or 'unknown'}", roles)


def authorize(principal: Principal, role: str) -> bool:
    return role in principal.roles


def principal_of(context: grpc.aio.ServicerContext[Any, Any], auth: Authenticator | None = None) -> Principal:
    """The caller of a call that passed the interceptor."""
    md = {k: v for k, v in context.invocation_metadata() or () if isinstance(v, str)}
    return authenticate(md, context.peer(), auth) or Principal("unknown")


Handler: TypeAlias = "grpc.RpcMethodHandler[Any, Any]"


class AuthInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, auth: Authenticator | None = None) -> None:
        self.auth = auth

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler | None]],
                                details: grpc.HandlerCallDetails) -> Handler | None:
        handler = await continuation(details)
        method = details.method
        if handler is None or method.startswith(OPEN_PREFIXES):
            return handler
        md = {k: v for k, v in details.invocation_metadata or () if isinstance(v, str)}
        # The peer address is not in the call details; the principal is only named, not trusted, by it.
        principal = authenticate(md, "", self.auth)
        if principal is None:
            return _refusal(handler, grpc.StatusCode.UNAUTHENTICATED, "missing or invalid credentials")
        role = ROLES.get(method)
        if role is None or not authorize(principal, role):
            return _refusal(handler, grpc.StatusCode.PERMISSION_DENIED,
                            bounded(f"{principal.name} may not call {method}" + ("" if role else " (no role defined)")))
        return handler


def _refusal(handler: Handler, code: grpc.StatusCode, details: str) -> Handler:
    """A handler of the same kind as ``handler`` that ends the call with ``code``."""

    async def unary(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        await context.abort(code, details)

    async def streaming(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        await context.abort(code, details)
        yield  # pragma: no cover - abort raises

    des, ser = handler.request_deserializer, handler.response_serializer
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(unary, des, ser)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(streaming, des, ser)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(unary, des, ser)
    return grpc.stream_stream_rpc_method_handler(streaming, des, ser)
