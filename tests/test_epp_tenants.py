"""The endpoint picker holds tenants to the same rules as the proxy (issue 11): with auth on, the tenant comes
from the client's credential that Envoy passes on (401 / 403 otherwise, as an ImmediateResponse), the
tenant's cache salt goes into the body Envoy forwards, the client's ``Authorization`` is replaced by the
workers' key (or removed); with admission on, a tenant over its limit is refused 429 with Retry-After, a
refused request writes nothing, and the admission is held until the response has gone through (or the
ext_proc stream broke off). Driven through the test's Envoy data plane (``tests/envoy.py``) and, for a
broken-off stream, message by message."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import grpc
import httpx

from kvgate.admission.gate import Admission
from kvgate.gateway.auth import tenant_salt
from kvgate.grpc.gen.envoy.service.ext_proc.v3 import external_processor_pb2_grpc as epgrpc
from kvgate.router.types import ConversationId
from kvgate.serving import ServerHandle, start_server
from tests.conftest import MODEL, Cluster
from tests.envoy import Envoy, request_body, request_headers, response_headers
from tests.helpers import auth, eventually
from tests.test_admission_gateway import LONG, SLOW

CHAT = "/v1/chat/completions"
DATA_PLANE_TOKEN = "data-plane-token-0123456789"


class Plane:
    """A cluster whose gateway serves as endpoint picker, and the Envoy data plane in front of it."""

    def __init__(self, c: Cluster, envoy: Envoy, handle: ServerHandle) -> None:
        self.c, self.envoy, self.handle = c, envoy, handle
        self.url = handle.url

    @property
    def epp_target(self) -> str:
        return f"127.0.0.1:{self.c.gateway_handle.server.config.app.state.grpc.epp_port}"  # type: ignore[union-attr]

    def admission(self) -> Admission:
        a = self.c.gateway.admission
        assert a is not None
        return a


@asynccontextmanager
async def plane(make_cluster: Any, n: int = 1, metadata: tuple[tuple[str, str], ...] = (),
                **kw: Any) -> AsyncIterator[Plane]:
    kw.setdefault("drain_timeout_s", 1)
    c: Cluster = await make_cluster(n, events=True, epp_port=0, **kw)
    port = c.gateway_handle.server.config.app.state.grpc.epp_port  # type: ignore[union-attr]
    envoy = Envoy(f"127.0.0.1:{port}", metadata=metadata)
    handle = await start_server(envoy.app)
    try:
        yield Plane(c, envoy, handle)
    finally:
        await handle.stop()
        await envoy.close()


def body(content: str = "hello", **kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **kw}


async def chat(p: Plane, headers: dict[str, str], key: str | None = None, **kw: Any) -> httpx.Response:
    h = {**headers, **({"authorization": f"Bearer {key}"} if key else {})}
    async with httpx.AsyncClient(timeout=30) as cl:
        return await cl.post(p.url + CHAT, headers=h, json=body(**kw))


async def test_the_tenant_is_the_credentials_and_the_client_is_told_why_not(make_cluster: Any) -> None:
    async with plane(make_cluster, auth=auth()) as p:
        for key in (None, "wrong-key"):
            r = await chat(p, {"x-conversation-id": "c1"}, key)
            assert r.status_code == 401, r.text
            assert r.headers["www-authenticate"].startswith("Bearer")
            assert r.json()["error"]["type"] == "authentication_error"
        r = await chat(p, {"x-conversation-id": "c1"}, "key-none")
        assert r.status_code == 403 and r.json()["error"]["code"] == "no_role"
        async with httpx.AsyncClient(timeout=30) as cl:  # a request kvgate does not route by prefix, too
            assert (await cl.get(p.url + "/v1/models")).status_code == 401
            assert (await cl.get(p.url + "/v1/models", headers={"authorization": "Bearer key-a"})).status_code == 200
        r = await chat(p, {"x-conversation-id": "conv", "x-tenant-id": "B"}, "key-a")
        assert r.status_code == 200, r.text
        assert r.headers["x-kvgate-conversation-id"] == "A/conv"
        store = p.c.gateway.store
        assert await store.peek(ConversationId("A/conv")) is not None
        assert await store.peek(ConversationId("B/conv")) is None
        # B cannot continue A's conversation by its response id.
        rid = r.json()["id"]
        r = await chat(p, {}, "key-b", previous_response_id=rid)
        assert r.status_code == 404, r.text
        assert (await store.peek(ConversationId("A/conv"))).turn_count == 1  # type: ignore[union-attr]


async def test_the_body_carries_the_tenants_salt_and_the_workers_key_replaces_the_clients(make_cluster: Any) -> None:
    sent: list[tuple[dict[str, str], dict[str, Any]]] = []
    # The data plane authenticates itself to the picker (issue 24): only then is the workers' key sent.
    async with plane(make_cluster, sim={"speed": 20.0, "api_key": "worker-secret"},
                     auth=auth(worker_api_key="worker-secret"), epp_auth={"tokens": [DATA_PLANE_TOKEN]},
                     metadata=(("authorization", f"Bearer {DATA_PLANE_TOKEN}"),)) as p:
        upstream = p.envoy._upstream

        async def spy(call: Any, method: str, path: str, headers: dict[str, str], data: bytes,
                      endpoints: list[str]) -> Any:
            sent.append((dict(headers), json.loads(data)))
            return await upstream(call, method, path, headers, data, endpoints)

        p.envoy._upstream = spy  # type: ignore[method-assign]
        r = await chat(p, {"x-conversation-id": "s1"}, "key-a", cache_salt="forged")
        assert r.status_code == 200, r.text
        headers, sent_body = sent[-1]
        assert headers["authorization"] == "Bearer worker-secret"
        assert sent_body["cache_salt"] == tenant_salt(p.c.gateway.settings.auth, "A") != "forged"
    # Without a workers' key the client's own credential does not reach the worker either.
    async with plane(make_cluster, sim={"speed": 20.0, "api_key": "key-a"}, auth=auth()) as p:
        assert (await chat(p, {}, "key-a")).status_code == 401


async def test_over_a_tenant_limit_is_429_and_a_refused_request_writes_nothing(make_cluster: Any) -> None:
    limits = {"requests_per_minute": 2, "tokens_per_minute": 10_000}
    async with plane(make_cluster, admission={"enabled": True, "defaults": limits}) as p:
        for i in range(2):
            r = await chat(p, {"x-tenant-id": "acme", "x-conversation-id": f"ok{i}"})
            assert r.status_code == 200, r.text
        assert r.headers["x-ratelimit-limit-requests"] == "2" and r.headers["x-ratelimit-remaining-requests"] == "0"
        r = await chat(p, {"x-tenant-id": "acme", "x-conversation-id": "refused"})
        assert r.status_code == 429, r.text
        assert 1 <= int(r.headers["retry-after"]) <= 30
        err = r.json()["error"]
        assert err["type"] == "requests" and err["code"] == "rate_limit_exceeded"
        assert (await chat(p, {"x-tenant-id": "other"})).status_code == 200
        store = p.c.gateway.store
        assert await store.peek(ConversationId("acme/ok0")) is not None
        assert await store.peek(ConversationId("acme/refused")) is None
        assert p.admission().rejected == {"requests_per_minute": 1}


async def test_admission_is_held_until_the_response_is_through_or_the_stream_breaks_off(make_cluster: Any) -> None:
    async with plane(make_cluster, sim=SLOW, admission={"enabled": True,
                                                        "tenants": {"solo": {"max_concurrent": 1}}}) as p:
        store: Any = p.admission().store
        ch = grpc.aio.insecure_channel(p.epp_target)
        stub = epgrpc.ExternalProcessorStub(ch)
        call = stub.Process()
        await call.write(request_headers(CHAT, {"x-tenant-id": "solo", "content-type": "application/json"}))
        await call.write(request_body(json.dumps(body(stream=True, **LONG)).encode(), True))
        first = await call.read()
        assert first.HasField("request_headers"), first
        await call.write(response_headers(200, {"content-type": "text/event-stream"}))
        await call.read()
        assert store.leases("solo") == 1
        r = await chat(p, {"x-tenant-id": "solo"})
        assert r.status_code == 429 and r.json()["error"]["type"] == "concurrent_requests"
        call.cancel()  # the client went away: Envoy resets the ext_proc stream
        await eventually(lambda: store.leases("solo") == 0)
        assert p.admission().busy(MODEL) == 0
        r = await chat(p, {"x-tenant-id": "solo"})
        assert r.status_code == 200, r.text
        await eventually(lambda: store.leases("solo") == 0)  # and released once it went through
        await ch.close()
