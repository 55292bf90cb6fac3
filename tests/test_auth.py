"""Authentication and roles (issue 11): API keys and JWTs on the proxy, /admin and the gRPC control API,
against a real gateway and simulated workers."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import grpc
import httpx
import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric import rsa
from jwt.algorithms import RSAAlgorithm

from kvgate.cli import main
from kvgate.gateway.auth import key_hash
from kvgate.grpc.gen.kvgate.v1 import fleet_pb2 as fpb
from kvgate.grpc.gen.kvgate.v1 import fleet_pb2_grpc as fgrpc
from kvgate.grpc.gen.kvgate.v1 import policy_pb2 as ppb
from kvgate.grpc.gen.kvgate.v1 import policy_pb2_grpc as pgrpc
from tests.conftest import MODEL, Cluster
from tests.helpers import KEYS, SECRET, auth


async def chat(c: Cluster, key: str | None, conv: str = "c1", headers: dict[str, str] | None = None,
               content: str = "hello") -> httpx.Response:
    h = {"x-conversation-id": conv, **(headers or {})}
    if key is not None:
        h["authorization"] = f"Bearer {key}"
    async with httpx.AsyncClient(timeout=30) as cl:
        return await cl.post(c.url + "/v1/chat/completions", headers=h,
                             json={"model": MODEL, "messages": [{"role": "user", "content": content}]})


async def admin(c: Cluster, method: str, path: str, key: str | None, **kw: Any) -> httpx.Response:
    h = {"authorization": f"Bearer {key}"} if key else {}
    async with httpx.AsyncClient(timeout=30) as cl:
        return await cl.request(method, c.url + path, headers=h, **kw)


async def test_no_or_bad_credential_is_401_openai_style(make_cluster: Any) -> None:
    c = await make_cluster(1, auth=auth())
    for key in (None, "wrong-key"):
        r = await chat(c, key)
        assert r.status_code == 401, r.text
        assert r.headers["www-authenticate"].startswith("Bearer")
        assert r.json()["error"]["type"] == "authentication_error"
        assert (await admin(c, "GET", "/admin/workers", key)).status_code == 401
    assert (await chat(c, "key-a")).status_code == 200
    # X-Api-Key works as well as Authorization: Bearer.
    async with httpx.AsyncClient(timeout=30) as cl:
        r = await cl.post(c.url + "/v1/chat/completions", headers={"x-api-key": "key-b"},
                          json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 200


async def test_wrong_role_is_403_and_policy_changes_name_who(make_cluster: Any) -> None:
    c = await make_cluster(1, auth=auth())
    before = c.gateway.cost.params
    r = await admin(c, "PATCH", "/admin/policy", "key-a", json={"cost": {"p0_ms": 1.0}})
    assert r.status_code == 403 and r.json()["error"]["code"] == "operator_required"
    assert c.gateway.cost.params is before
    for path in ("/admin/policy", "/admin/workers", "/admin/tiers"):
        assert (await admin(c, "GET", path, "key-a")).status_code == 403, path
    assert (await chat(c, "key-none")).status_code == 403  # authenticated, no role
    assert (await chat(c, "key-ops")).status_code == 403  # an operator key bound to no tenant
    r = await admin(c, "PATCH", "/admin/policy", "key-ops", json={"cost": {"p0_ms": 1.0}, "reason": "test"})
    assert r.status_code == 200, r.text
    assert c.gateway.cost.params.p0_ms == 1.0
    assert c.gateway.policy_log.recent()[-1].who.startswith("key:key-ops@")


async def test_tenant_header_is_ignored_when_auth_is_on(make_cluster: Any) -> None:
    c = await make_cluster(1, auth=auth())
    r = await chat(c, "key-a", "conv", headers={"x-tenant-id": "B"})
    assert r.status_code == 200
    assert r.headers["x-kvgate-conversation-id"] == "A/conv"
    rec = (await admin(c, "GET", "/admin/conversations/A/conv", "key-ops")).json()
    assert rec["tenant"] == "A"
    assert (await admin(c, "GET", "/admin/conversations/B/conv", "key-ops")).status_code == 404


async def test_api_keys_are_held_as_hashes_and_read_from_a_mounted_file(make_cluster: Any, tmp_path: Path) -> None:
    f = tmp_path / "keys.yaml"
    f.write_text(json.dumps([{"sha256": key_hash("file-key"), "tenant": "F", "role": "tenant", "name": "f"}]))
    c = await make_cluster(1, auth={"mode": "api_key", "api_keys_file": str(f), "cache_salt_secret": SECRET})
    assert "file-key" not in c.gateway.settings.model_dump_json()
    assert (await chat(c, "file-key")).status_code == 200
    # The hash itself is not a key.
    assert (await chat(c, key_hash("file-key"))).status_code == 401


def rsa_jwks(tmp_path: Path) -> tuple[Any, Path]:
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    jwk = json.loads(RSAAlgorithm.to_jwk(key.public_key()))
    path = tmp_path / "jwks.json"
    path.write_text(json.dumps({"keys": [{**jwk, "kid": "k1", "alg": "RS256", "use": "sig"}]}))
    return key, path


def token(key: Any, **claims: Any) -> str:
    base = {"iss": "https://idp.test", "aud": "kvgate", "sub": "alice", "exp": int(time.time()) + 600}
    return jwt.encode({**base, **claims}, key, algorithm="RS256", headers={"kid": "k1"})


async def test_jwt_from_a_local_jwks_file(make_cluster: Any, tmp_path: Path) -> None:
    key, path = rsa_jwks(tmp_path)
    c = await make_cluster(1, auth={"mode": "jwt", "cache_salt_secret": SECRET, "jwt": {
        "jwks_file": str(path), "issuer": "https://idp.test", "audience": "kvgate", "tenant_claim": "org.id",
        "role_claim": "roles"}})
    good = token(key, org={"id": "acme"}, roles=["kvgate:tenant"])
    r = await chat(c, good, "j1", headers={"x-tenant-id": "other"})
    assert r.status_code == 200, r.text
    assert r.headers["x-kvgate-conversation-id"] == "acme/j1"
    assert (await admin(c, "GET", "/admin/workers", good)).status_code == 403
    ops = token(key, sub="bob", roles=["kvgate:operator"])
    assert (await admin(c, "GET", "/admin/workers", ops)).status_code == 200
    other = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    for bad in (token(key, aud="someone-else", org={"id": "acme"}, roles=["tenant"]),
                token(key, exp=int(time.time()) - 600, org={"id": "acme"}, roles=["tenant"]),
                token(other, org={"id": "acme"}, roles=["tenant"])):
        r = await chat(c, bad)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_token", r.text


async def test_client_authorization_is_not_forwarded_worker_key_is(make_cluster: Any) -> None:
    # The simulated worker demands its own key, as vLLM --api-key does.
    c = await make_cluster(1, sim={"speed": 20.0, "api_key": "worker-secret"},
                           auth=auth(worker_api_key="worker-secret"))
    assert (await chat(c, "key-a")).status_code == 200
    c2 = await make_cluster(1, sim={"speed": 20.0, "api_key": "key-a"}, auth=auth())
    # The client's key is kvgate's, not the worker's: the worker never sees it, so it refuses.
    assert (await chat(c2, "key-a")).status_code != 200


async def test_grpc_control_api_and_ctl_take_the_same_keys(make_cluster: Any, capsys: pytest.CaptureFixture[str]
                                                           ) -> None:
    c = await make_cluster(1, grpc_port=0, auth=auth())
    port = c.gateway_handle.server.config.app.state.grpc.control_port
    target = f"127.0.0.1:{port}"
    async with grpc.aio.insecure_channel(target) as ch:
        stub = fgrpc.FleetStub(ch)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.ListWorkers(fpb.ListWorkersRequest(), timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.ListWorkers(fpb.ListWorkersRequest(), timeout=5, metadata=[("authorization", "Bearer key-a")])
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        await stub.ListWorkers(fpb.ListWorkersRequest(), timeout=5, metadata=[("x-api-key", "key-ops")])
        await pgrpc.PolicyStub(ch).UpdatePolicy(ppb.UpdatePolicyRequest(cost=ppb.CostParams(p0_ms=2)), timeout=5,
                                                metadata=[("authorization", "Bearer key-ops")])
        assert c.gateway.policy_log.recent()[-1].who.startswith("key:key-ops@")

    async def ctl(*args: str) -> int:
        try:
            await asyncio.to_thread(main, ["ctl", "--target", target, *args])
        except SystemExit as exc:
            return int(exc.code or 0)
        return 0

    assert await ctl("workers") != 0
    assert await ctl("--api-key", "key-ops", "workers") == 0
    assert json.loads(capsys.readouterr().out)["workers"]


async def test_jwks_from_a_url_is_fetched_and_refreshed_keys_replace_old_ones(tmp_path: Path) -> None:
    from fastapi import FastAPI

    from kvgate.gateway.auth import Authenticator, Unauthenticated
    from kvgate.serving import start_server
    from kvgate.settings.auth import AuthSettings

    key, path = rsa_jwks(tmp_path)
    app = FastAPI()

    @app.get("/jwks")
    async def jwks() -> Any:
        return json.loads(path.read_text())

    idp = await start_server(app)
    auth = Authenticator(AuthSettings.model_validate({
        "mode": "jwt", "cache_salt_secret": SECRET, "jwt": {"jwks_url": idp.url + "/jwks", "issuer": "https://idp.test",
                                                            "audience": "kvgate", "cache_s": 0}}))
    try:
        await auth.start()
        p = auth.authenticate({"authorization": f"Bearer {token(key, tenant='acme', role='tenant')}"})
        assert (p.tenant, p.role, p.name) == ("acme", "tenant", "jwt:alice")
        # The provider rotates its key: after a refresh the old one no longer verifies, the new one does.
        new_key, _ = rsa_jwks(tmp_path)
        await auth.refresh()
        with pytest.raises(Unauthenticated):
            auth.authenticate({"authorization": f"Bearer {token(key, tenant='acme', role='tenant')}"})
        assert auth.authenticate({"x-api-key": token(new_key, tenant="acme", role="operator")}).operator
    finally:
        await auth.stop()
        await idp.stop()


def test_settings_refuse_auth_without_a_salt_secret_or_keys_source(clean_env: pytest.MonkeyPatch) -> None:
    from pydantic import ValidationError

    from kvgate.config import GatewaySettings
    from kvgate.settings.auth import AuthSettings

    with pytest.raises(ValidationError, match="cache_salt_secret"):
        AuthSettings(mode="api_key")
    with pytest.raises(ValidationError, match="jwks_file or jwks_url"):
        AuthSettings(mode="jwt", cache_salt=False)
    with pytest.raises(ValidationError, match="two sharing groups"):
        AuthSettings(sharing_groups={"g1": ["A"], "g2": ["A"]})
    # The whole block is one JSON value in the environment.
    clean_env.setenv("KVGATE_AUTH", json.dumps(auth()))
    s = GatewaySettings()
    assert s.auth.mode == "api_key" and len(s.auth.api_keys) == len(KEYS)
