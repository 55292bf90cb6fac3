"""The gateway's gRPC servers, each on its own port and both off unless configured:

- the control API (``grpc_port``): ``kvgate.v1`` Routing, Conversations, Policy and Fleet behind the
  authentication hook (``auth.py``), with the standard health service (``""`` and each service name) and
  server reflection (``grpcurl`` lists and calls the services without the protos);
- the endpoint picker (``epp_port``): ``envoy.service.ext_proc.v3.ExternalProcessor`` for Envoy, with the
  health services the endpoint picker protocol names: ``liveness`` (the process answers), ``readiness``
  and ``envoy.service.ext_proc.v3.ExternalProcessor`` (a healthy worker for every model, not draining).

Both run on the gateway's event loop (``grpc.aio``) and share its state with the HTTP front.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from kvgate.epp.service import ExtProcService
from kvgate.epp.trust import server_credentials
from kvgate.grpc.auth import AuthInterceptor
from kvgate.grpc.decisions import DecisionBus
from kvgate.grpc.explain import decision_pb
from kvgate.grpc.gen.envoy.service.ext_proc.v3 import external_processor_pb2_grpc as epgrpc
from kvgate.grpc.gen.kvgate.v1 import conversations_pb2_grpc as cgrpc
from kvgate.grpc.gen.kvgate.v1 import fleet_pb2_grpc as fgrpc
from kvgate.grpc.gen.kvgate.v1 import policy_pb2_grpc as pgrpc
from kvgate.grpc.gen.kvgate.v1 import routing_pb2_grpc as rgrpc
from kvgate.grpc.malformed import MalformedGuard
from kvgate.grpc.services import ConversationsService, FleetService, PolicyService, RoutingService

if TYPE_CHECKING:
    from kvgate.gateway.parts import Parts

log = logging.getLogger(__name__)

CONTROL_SERVICES = ("kvgate.v1.Routing", "kvgate.v1.Conversations", "kvgate.v1.Policy", "kvgate.v1.Fleet")
EXT_PROC = "envoy.service.ext_proc.v3.ExternalProcessor"
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
READINESS_EVERY_S = 1.0


@dataclass
class GrpcServers:
    control: grpc.aio.Server | None = None
    control_port: int | None = None
    epp: grpc.aio.Server | None = None
    epp_port: int | None = None
    bus: DecisionBus | None = None
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)

    async def stop(self, grace_s: float = 5.0) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        for s in (self.control, self.epp):
            if s is not None:
                await s.stop(grace_s)


def _options(gw: Parts) -> list[tuple[str, int]]:
    # A request body (Explain's JSON, an ext_proc body chunk) may be as large as the HTTP front accepts.
    n = gw.settings.max_body_bytes + (1 << 20)
    return [("grpc.max_receive_message_length", n), ("grpc.max_send_message_length", n)]


def _bind(server: grpc.aio.Server, host: str, port: int, creds: grpc.ServerCredentials | None = None) -> int:
    addr = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    bound = server.add_insecure_port(addr) if creds is None else server.add_secure_port(addr, creds)
    if bound == 0:
        raise OSError(f"gRPC: cannot listen on {addr}")
    return bound


async def _control(gw: Parts, servers: GrpcServers, port: int) -> None:
    # The auth hook first: a caller without credentials is refused whatever bytes it sent.
    server = grpc.aio.server(interceptors=[AuthInterceptor(gw.auth), MalformedGuard()], options=_options(gw))
    bus = DecisionBus(lambda d: decision_pb(gw, d))
    gw.router.listeners.append(bus)
    rgrpc.add_RoutingServicer_to_server(RoutingService(gw, bus), server)
    cgrpc.add_ConversationsServicer_to_server(ConversationsService(gw), server)
    pgrpc.add_PolicyServicer_to_server(PolicyService(gw), server)
    fgrpc.add_FleetServicer_to_server(FleetService(gw), server)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    for name in ("", *CONTROL_SERVICES):
        await health.set(name, SERVING)
    reflection.enable_server_reflection((*CONTROL_SERVICES, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                                         reflection.SERVICE_NAME), server)
    servers.control_port = _bind(server, gw.settings.host, port)
    await server.start()
    servers.control, servers.bus = server, bus
    log.info("gRPC control API on %s:%d", gw.settings.host, servers.control_port)


def ready(gw: Parts) -> bool:
    per_model = gw.pool.ready()
    return bool(per_model) and all(per_model.values()) and not gw.draining


async def _epp(gw: Parts, servers: GrpcServers, port: int) -> None:
    server = grpc.aio.server(interceptors=[MalformedGuard()], options=_options(gw))
    epgrpc.add_ExternalProcessorServicer_to_server(ExtProcService(gw), server)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    await health.set("liveness", SERVING)
    reflection.enable_server_reflection((EXT_PROC, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                                         reflection.SERVICE_NAME), server)
    servers.epp_port = _bind(server, gw.settings.host, port, server_credentials(gw.settings.epp_auth))
    await server.start()
    servers.epp = server

    async def readiness() -> None:
        while True:
            status = SERVING if ready(gw) else NOT_SERVING
            for name in ("", "readiness", EXT_PROC):
                await health.set(name, status)
            await asyncio.sleep(READINESS_EVERY_S)

    servers._tasks.append(asyncio.get_running_loop().create_task(readiness(), name="epp-readiness"))
    log.info("endpoint picker (Envoy ext_proc) on %s:%d", gw.settings.host, servers.epp_port)


async def start_grpc(gw: Parts) -> GrpcServers:
    """Start what the settings ask for (nothing by default)."""
    servers = GrpcServers()
    try:
        if gw.settings.grpc_port is not None:
            await _control(gw, servers, gw.settings.grpc_port)
        if gw.settings.epp_port is not None:
            await _epp(gw, servers, gw.settings.epp_port)
    except BaseException:
        await servers.stop(0)
        raise
    return servers
