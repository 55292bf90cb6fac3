"""The endpoint picker's trust boundary (issue 24), through real gRPC channels (plaintext and TLS with
certificates made here) against a gateway with simulated workers:

- a caller without the shared token, or without a client certificate of the configured CA, is refused
  before anything is read; an authenticated caller is sent the workers' key; a picker allowed to serve
  unauthenticated callers never sends it, and one holding a key with no caller authentication does not
  start;
- response phases are the stream's claims: 18 forged ``:status: 503`` from tenant A leave the workers
  healthy for tenant B (on a0afb21 they ejected both), and a claimed 503 only makes kvgate look sooner.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import json
from collections import Counter
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pydantic import ValidationError

from kvgate.config import GatewaySettings
from kvgate.epp import protocol as proto
from kvgate.grpc.gen.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from kvgate.grpc.gen.envoy.service.ext_proc.v3 import external_processor_pb2_grpc as epgrpc
from kvgate.serving import start_server
from tests.conftest import MODEL, Cluster
from tests.envoy import Envoy, destination, request_body, request_headers, response_body, response_headers
from tests.helpers import eventually, metric

CHAT = "/v1/chat/completions"
TOKEN = "envoy-to-kvgate-0123456789abcdef"
WORKER_KEY = "the-fleets-worker-key"
ENVOY_ID = "spiffe://cluster.local/ns/envoy-gateway-system/sa/envoy"


def chat_body(user: str = "hello") -> bytes:
    return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": user}], "max_tokens": 4}).encode()


def epp_target(c: Cluster) -> str:
    return f"127.0.0.1:{c.gateway_handle.server.config.app.state.grpc.epp_port}"  # type: ignore[union-attr]


async def pick(stub: Any, metadata: tuple[tuple[str, str], ...] = (), tenant: str = "A") -> ep.ProcessingResponse:
    """One request's headers and body; the picker's first answer (the pick, or an immediate response)."""
    call = stub.Process(metadata=metadata)
    await call.write(request_headers(CHAT, {"content-type": "application/json", "x-tenant-id": tenant}))
    await call.write(request_body(chat_body(), True))
    r: ep.ProcessingResponse = await call.read()
    call.cancel()
    return r


async def refusal(stub: Any, metadata: tuple[tuple[str, str], ...] = ()) -> grpc.StatusCode:
    """How the picker ends a stream it refuses. The refusal may come before the client's second write,
    which then fails on its own: the call's status is what Envoy would see."""
    call = stub.Process(metadata=metadata)
    with pytest.raises(grpc.aio.AioRpcError):
        # One write only: a second one racing the refusal can end the call with grpc-core's own INTERNAL
        # ("Internal error from Core", seen under load) instead of the status the picker sent.
        await call.write(request_headers(CHAT, {"content-type": "application/json"}))
        await call.read()
    code: grpc.StatusCode = await call.code()
    return code


def mutation(r: ep.ProcessingResponse) -> tuple[dict[str, str], list[str]]:
    m = r.request_headers.response.header_mutation
    return {o.header.key: o.header.raw_value.decode() for o in m.set_headers}, list(m.remove_headers)


# -- settings -------------------------------------------------------------------------------------
def test_a_picker_holding_the_workers_key_needs_its_callers_authenticated() -> None:
    key = {"worker_api_key": WORKER_KEY}
    with pytest.raises(ValidationError, match="epp_auth"):
        GatewaySettings(epp_port=9002, auth=key)
    GatewaySettings(epp_port=9002, auth=key, epp_auth={"tokens": [TOKEN]})
    GatewaySettings(epp_port=9002, auth=key, epp_auth={"allow_unauthenticated": True})
    GatewaySettings(auth=key)  # no picker: nothing to hand the key to
    GatewaySettings(epp_port=9002)  # no key: served as before (callers unauthenticated, nothing secret sent)
    for bad in ({"tokens": ["short"]}, {"client_ca_file": "/ca.pem"}, {"tls_cert_file": "/c.pem"},
                {"client_names": ["x"]}, {"tokens": [TOKEN], "allow_unauthenticated": True}):
        with pytest.raises(ValidationError, match="epp_auth"):
            GatewaySettings(epp_port=9002, epp_auth=bad)


# -- the shared token -----------------------------------------------------------------------------
async def test_a_caller_without_the_token_is_refused_and_the_data_plane_gets_the_key(make_cluster: Any) -> None:
    c = await make_cluster(2, drain_timeout_s=1, epp_port=0, auth={"worker_api_key": WORKER_KEY},
                           epp_auth={"tokens": ["an-older-token-being-rotated-out", TOKEN]})
    async with grpc.aio.insecure_channel(epp_target(c)) as ch:
        stub = epgrpc.ExternalProcessorStub(ch)
        for md in ((), (("authorization", "Bearer not-the-token-0123456789"),), (("authorization", TOKEN),)):
            assert await refusal(stub, md) == grpc.StatusCode.UNAUTHENTICATED
        assert await metric(c, "kvgate_epp_streams_total", outcome="unauthenticated") == 3
        r = await pick(stub, (("authorization", f"Bearer {TOKEN}"),))
        headers, _ = mutation(r)
        assert headers["authorization"] == f"Bearer {WORKER_KEY}" and proto.DESTINATION in headers
        # Probes carry no credentials: health stays open.
        health = health_pb2_grpc.HealthStub(ch)
        ok = await health.Check(health_pb2.HealthCheckRequest(service="liveness"), timeout=5)
        assert ok.status == health_pb2.HealthCheckResponse.SERVING


async def test_an_unauthenticated_picker_never_sends_the_workers_key(make_cluster: Any) -> None:
    c = await make_cluster(1, drain_timeout_s=1, epp_port=0, auth={"worker_api_key": WORKER_KEY},
                           epp_auth={"allow_unauthenticated": True})
    async with grpc.aio.insecure_channel(epp_target(c)) as ch:
        stub = epgrpc.ExternalProcessorStub(ch)
        for md in ((), (("authorization", f"Bearer {TOKEN}"),)):
            r = await pick(stub, md)
            headers, removed = mutation(r)
            assert proto.DESTINATION in headers
            assert WORKER_KEY not in r.SerializeToString().decode(errors="replace")
            assert "authorization" not in headers and "authorization" in removed


# -- mutual TLS -----------------------------------------------------------------------------------
def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _cert(subject: str, issuer: tuple[x509.Name, ec.EllipticCurvePrivateKey] | None,
          sans: list[x509.GeneralName], ca: bool = False) -> tuple[bytes, bytes, x509.Name, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = _name(subject)
    issuer_name, issuer_key = issuer if issuer is not None else (name, key)
    now = datetime.datetime.now(datetime.UTC)
    b = (x509.CertificateBuilder().subject_name(name).issuer_name(issuer_name).public_key(key.public_key())
         .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
         .not_valid_after(now + datetime.timedelta(days=1))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if sans:
        b = b.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    cert = b.sign(issuer_key, hashes.SHA256())
    pem_key = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    return cert.public_bytes(serialization.Encoding.PEM), pem_key, name, key


class Pki:
    """A CA, the picker's server certificate, Envoy's client certificate, and a stranger's from another CA."""

    def __init__(self, d: Path) -> None:
        self.ca, _, ca_name, ca_key = _cert("kvgate test CA", None, [], ca=True)
        self.server, self.server_key, _, _ = _cert("kvgate-epp", (ca_name, ca_key), [
            x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
        self.envoy, self.envoy_key, _, _ = _cert("envoy", (ca_name, ca_key),
                                                 [x509.UniformResourceIdentifier(ENVOY_ID)])
        self.other_pod, self.other_pod_key, _, _ = _cert("some-pod", (ca_name, ca_key), [x509.DNSName("some-pod")])
        _, _, other_name, other_key = _cert("another CA", None, [], ca=True)
        self.stranger, self.stranger_key, _, _ = _cert("envoy", (other_name, other_key),
                                                       [x509.UniformResourceIdentifier(ENVOY_ID)])
        self.files: dict[str, str] = {}
        for name, data in (("ca.pem", self.ca), ("tls.crt", self.server), ("tls.key", self.server_key)):
            (d / name).write_bytes(data)
            self.files[name] = str(d / name)

    def rotate(self, d: Path) -> None:
        """cert-manager's rotation: a new CA, the picker's and Envoy's certificates re-issued, the files
        replaced where the picker reads them."""
        self.__init__(d)  # type: ignore[misc]

    def settings(self, **kw: Any) -> dict[str, Any]:
        return {"tls_cert_file": self.files["tls.crt"], "tls_key_file": self.files["tls.key"],
                "client_ca_file": self.files["ca.pem"], **kw}

    def channel(self, target: str, cert: bytes | None = None, key: bytes | None = None) -> grpc.aio.Channel:
        creds = grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=key, certificate_chain=cert)
        return grpc.aio.secure_channel(target, creds)


async def test_mutual_tls_refuses_a_caller_without_a_certificate_of_the_ca(make_cluster: Any, tmp_path: Path) -> None:
    pki = Pki(tmp_path)
    c = await make_cluster(1, drain_timeout_s=1, epp_port=0, auth={"worker_api_key": WORKER_KEY},
                           epp_auth=pki.settings(client_names=[ENVOY_ID]))
    target = epp_target(c)
    async with grpc.aio.insecure_channel(target) as ch:  # plaintext to a TLS port: no handshake at all
        assert await refusal(epgrpc.ExternalProcessorStub(ch)) == grpc.StatusCode.UNAVAILABLE
    # No client certificate, or one another CA signed: the handshake fails, nothing is read.
    for cert, key in ((None, None), (pki.stranger, pki.stranger_key)):
        async with pki.channel(target, cert, key) as ch:
            assert await refusal(epgrpc.ExternalProcessorStub(ch)) == grpc.StatusCode.UNAVAILABLE
    # The right CA, but a certificate naming some other workload (a mesh CA signs every pod's).
    async with pki.channel(target, pki.other_pod, pki.other_pod_key) as ch:
        assert await refusal(epgrpc.ExternalProcessorStub(ch)) == grpc.StatusCode.PERMISSION_DENIED
    async with pki.channel(target, pki.envoy, pki.envoy_key) as ch:
        headers, _ = mutation(await pick(epgrpc.ExternalProcessorStub(ch)))
        assert headers["authorization"] == f"Bearer {WORKER_KEY}"


async def test_mutual_tls_and_the_token_together_need_both(make_cluster: Any, tmp_path: Path) -> None:
    pki = Pki(tmp_path)
    c = await make_cluster(1, drain_timeout_s=1, epp_port=0, auth={"worker_api_key": WORKER_KEY},
                           epp_auth=pki.settings(tokens=[TOKEN]))
    async with pki.channel(epp_target(c), pki.envoy, pki.envoy_key) as ch:
        stub = epgrpc.ExternalProcessorStub(ch)
        assert await refusal(stub) == grpc.StatusCode.UNAUTHENTICATED
        headers, _ = mutation(await pick(stub, (("authorization", f"Bearer {TOKEN}"),)))
        assert headers["authorization"] == f"Bearer {WORKER_KEY}"


async def test_rotated_certificate_files_are_read_on_the_next_handshake(make_cluster: Any, tmp_path: Path) -> None:
    pki = Pki(tmp_path)
    c = await make_cluster(1, drain_timeout_s=1, epp_port=0, auth={"worker_api_key": WORKER_KEY},
                           epp_auth=pki.settings())
    target = epp_target(c)
    old = (pki.ca, pki.envoy, pki.envoy_key)
    pki.rotate(tmp_path)
    async with pki.channel(target, pki.envoy, pki.envoy_key) as ch:  # the new CA, without a restart
        headers, _ = mutation(await pick(epgrpc.ExternalProcessorStub(ch)))
        assert headers["authorization"] == f"Bearer {WORKER_KEY}"
    creds = grpc.ssl_channel_credentials(root_certificates=old[0], private_key=old[2], certificate_chain=old[1])
    async with grpc.aio.secure_channel(target, creds) as ch:  # the old CA's client is not trusted any more
        assert await refusal(epgrpc.ExternalProcessorStub(ch)) == grpc.StatusCode.UNAVAILABLE


# -- response phases are claims -------------------------------------------------------------------
async def open_pick(stub: Any, i: int, tenant: str = "A") -> tuple[Any, str]:
    """A stream that got a pick and holds it (the worker's slot stays taken until the response ends)."""
    call = stub.Process()
    await call.write(request_headers(CHAT, {"content-type": "application/json", "x-tenant-id": tenant,
                                            "x-conversation-id": f"forger-{i}"}))
    await call.write(request_body(chat_body(f"forged {i}"), True))
    w = destination(await call.read()).split(",")[0]
    while not (await call.read()).request_body.response.body_mutation.streamed_response.end_of_stream:
        pass
    return call, w


async def forge(call: Any, status: int) -> None:
    """Answer a pick with response phases of the stream's own making."""
    await call.write(response_headers(status, {"content-type": "text/plain"}))
    await call.read()
    await call.write(response_body(b"forged", True))
    await call.read()
    await call.done_writing()


async def test_forged_503s_of_one_tenant_do_not_fail_another_tenants_requests(make_cluster: Any) -> None:
    # The production health interval: an ejected worker stays out until its next active check.
    c = await make_cluster(2, drain_timeout_s=1, epp_port=0, health_interval_s=5.0)
    await eventually(lambda: all(w.healthy for w in c.gateway.pool.all()), timeout_s=10)
    workers = {w.id for w in c.gateway.pool.all()}
    envoy = Envoy(epp_target(c))
    dp = await start_server(envoy.app)
    try:
        # A's 18 streams hold their picks at once (spread over both workers by load), then all claim 503.
        held = [await open_pick(envoy.stub, i) for i in range(18)]
        assert {w for _, w in held} == workers
        for call, _ in held:
            await forge(call, 503)

        async def b(i: int, cl: httpx.AsyncClient) -> int:
            r = await cl.post(dp.url + CHAT, headers={"x-tenant-id": "B", "x-conversation-id": f"b{i}"},
                              json={"model": MODEL, "messages": [{"role": "user", "content": f"q{i}"}],
                                    "max_tokens": 4})
            return r.status_code

        statuses: Counter[int] = Counter()
        async with httpx.AsyncClient(timeout=30) as cl:
            for start in range(0, 90, 10):
                statuses.update(await asyncio.gather(*(b(i, cl) for i in range(start, start + 10))))
        print(f"\nB's 90 requests after A's 18 forged 503s: {dict(statuses)}")
        assert statuses == Counter({200: 90})
        assert {p.split(",")[0] for p in envoy.picks[18:]} <= workers
        assert all(w.healthy and w.health.failures == 0 for w in c.gateway.pool.all())
        # Counted as what they are: claims, not failures kvgate saw.
        assert await metric(c, "kvgate_epp_reported_status_total", status="5xx") == 18
        assert await metric(c, "kvgate_upstream_failures_total") == 0
    finally:
        await dp.stop()
        await envoy.close()


async def test_a_claimed_503_makes_kvgate_check_the_worker_itself(make_cluster: Any) -> None:
    # Active checks once a minute: only the early check a claim asks for can find the dead worker in time.
    c = await make_cluster(2, drain_timeout_s=1, epp_port=0, health_interval_s=60.0)
    await eventually(lambda: all(w.healthy for w in c.gateway.pool.all()), timeout_s=10)
    async with grpc.aio.insecure_channel(epp_target(c)) as ch:
        stub = epgrpc.ExternalProcessorStub(ch)
        call = stub.Process()
        await call.write(request_headers(CHAT, {"content-type": "application/json"}))
        await call.write(request_body(chat_body(), True))
        w = destination(await call.read()).split(",")[0]
        _, handle = c.worker_by_id(w)
        await handle.stop()  # the worker really is gone: kvgate's own connection is refused
        await call.write(response_headers(503, {"content-type": "text/plain"}))
        await call.read()
        await eventually(lambda: not c.gateway.pool.get(w).healthy, timeout_s=5)
        assert "/health" in c.gateway.pool.get(w).last_error  # kvgate's evidence, not the claim
        call.cancel()
