"""Who is calling, and what they may do (issue 11): API keys and JWT bearer tokens, each bound to a tenant
and a role, and the per-tenant ``cache_salt`` that keeps one tenant's KV cache out of another's reach.

The core (``Authenticator``, ``salt_for``) knows nothing of HTTP or gRPC: it takes a mapping of header
names (lower case) to values and answers a ``Principal`` or raises ``Unauthenticated``. The HTTP front
(``require``) and the gRPC interceptor (kvgate/grpc/auth.py) are thin adapters over it.

Credentials: ``Authorization: Bearer <token>`` or ``X-Api-Key: <token>``. A token with two dots is a JWT
(when jwt is enabled); anything else is an API key, looked up by its sha256 so the gateway never holds
a key itself — a leaked config or Secret leaks hashes, not keys.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import httpx
import jwt
import yaml

from kvgate.errors import ApiError
from kvgate.settings.auth import ApiKey, AuthSettings, JwtSettings, Role
from kvgate.tasks import cancel_and_wait, stopping

log = logging.getLogger(__name__)

@dataclass(frozen=True, slots=True)
class Principal:
    name: str
    """Who, for logs: ``key:<name>``, ``jwt:<sub>``, or ``anonymous``."""
    tenant: str
    role: Role
    via: Literal["api_key", "jwt", "anonymous"]

    @property
    def operator(self) -> bool:
        return self.role == "operator"


ANONYMOUS = Principal("anonymous", "", "operator", "anonymous")
"""Auth off: everyone may do everything, as before issue 11; the tenant comes from the tenant header."""


class Unauthenticated(ApiError):
    status = 401
    type = "authentication_error"

    def __init__(self, message: str, code: str = "invalid_api_key") -> None:
        super().__init__(message, None, code, {"WWW-Authenticate": 'Bearer realm="kvgate"'})


class Forbidden(ApiError):
    status = 403
    type = "permission_error"


def key_hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def salt_for(secret: bytes, tenant: str, groups: Mapping[str, list[str]]) -> str:
    """The ``cache_salt`` of ``tenant``: HMAC of its sharing group's name if it has one, else of its own
    name — unguessable without the secret, so a client cannot forge another tenant's salt."""
    subject = next((f"group:{g}" for g, members in groups.items() if tenant in members), f"tenant:{tenant}")
    return hmac.new(secret, subject.encode(), hashlib.sha256).hexdigest()[:32]


def tenant_salt(settings: AuthSettings, tenant: str) -> str | None:
    """The ``cache_salt`` kvgate injects for ``tenant``'s requests; None when salting is off."""
    if not settings.enabled or not settings.cache_salt or settings.cache_salt_secret is None:
        return None
    return salt_for(settings.cache_salt_secret.get_secret_value().encode(), tenant, settings.sharing_groups)


MAX_CREDENTIAL_BYTES = 16 * 1024
"""A longer token is refused before it is hashed or decoded: a JWT's header and payload are base64 and
JSON (four 1 MiB JWT-shaped tokens held the event loop 1.2 s); real ones, groups and all, stay under 8 KiB."""


def credential(headers: Mapping[str, str]) -> str | None:
    """The token a request carries: ``Authorization: Bearer`` first, then ``X-Api-Key``."""
    auth = headers.get("authorization") or ""
    if len(auth) > MAX_CREDENTIAL_BYTES or len(headers.get("x-api-key") or "") > MAX_CREDENTIAL_BYTES:
        raise Unauthenticated(f"Credentials longer than {MAX_CREDENTIAL_BYTES} bytes are not accepted.",
                              "credential_too_long")
    scheme, _, token = auth.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    key = headers.get("x-api-key")
    return key.strip() if key and key.strip() else None


def _claim(claims: Mapping[str, Any], path: str) -> Any:
    value: Any = claims
    for part in path.split("."):
        if not isinstance(value, Mapping):
            return None
        value = value.get(part)
    return value


def role_of(claims: Mapping[str, Any], s: JwtSettings) -> Role:
    raw = _claim(claims, s.role_claim)
    values = [raw] if isinstance(raw, str) else [v for v in raw if isinstance(v, str)] if isinstance(raw, list) \
        else []
    if any(v in s.operator_values for v in values):
        return "operator"
    if any(v in s.tenant_values for v in values):
        return "tenant"
    return s.default_role


def load_keys(path: Path) -> list[ApiKey]:
    data = yaml.safe_load(path.read_text()) or []
    if isinstance(data, dict):
        data = data.get("api_keys", [])
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a list of API keys")
    return [ApiKey.model_validate(d) for d in data]


class Authenticator:
    """Verifies credentials against the configured keys and JWKS. One per gateway; its caches are its own."""

    def __init__(self, settings: AuthSettings, client: httpx.AsyncClient | None = None,
                 now: Callable[[], float] = time.time) -> None:
        self.settings = settings
        self._client = client
        self._now = now
        self._static = {k.sha256.lower(): k for k in settings.api_keys}
        self._file_keys: dict[str, ApiKey] = {}
        self._file_mtime: float | None = None
        self._jwks: jwt.PyJWKSet | None = None
        self._verified: OrderedDict[str, tuple[float, Principal]] = OrderedDict()
        self._task: asyncio.Task[None] | None = None
        self._reload_keys()
        if settings.jwt.jwks_file is not None and settings.mode in ("jwt", "both"):
            self._load_jwks(json.loads(settings.jwt.jwks_file.read_text()))

    # -- lifecycle (the JWKS refresh) ---------------------------------------------------------------
    async def start(self) -> None:
        if self.settings.mode in ("jwt", "both") and self.settings.jwt.jwks_url:
            await self._fetch_jwks()
        if self.settings.enabled:
            self._task = asyncio.create_task(self._refresh_loop(), name="auth-refresh")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None

    async def refresh(self, jwks: bool = True) -> None:
        """Re-read the API key file (if it changed) and, with ``jwks``, the JWKS; a failure keeps the
        last good keys."""
        try:
            await asyncio.to_thread(self._reload_keys)
            if jwks and self.settings.mode in ("jwt", "both"):
                if self.settings.jwt.jwks_url:
                    await self._fetch_jwks()
                elif self.settings.jwt.jwks_file is not None:
                    self._load_jwks(json.loads(self.settings.jwt.jwks_file.read_text()))
        except Exception as exc:  # a bad refresh (file, network, JSON) keeps the last good keys
            log.warning("auth: refresh failed, keeping the previous keys: %s", exc)

    async def _refresh_loop(self) -> None:
        # The key file is checked at least every 30 s (a rotated Secret takes effect without a restart);
        # the JWKS every jwks_refresh_s.
        every = self.settings.jwt.jwks_refresh_s
        last = time.monotonic()
        while not stopping():
            await asyncio.sleep(min(every, 30.0))
            due = time.monotonic() - last >= every
            await self.refresh(jwks=due)
            if due:
                last = time.monotonic()

    async def _fetch_jwks(self) -> None:
        url = self.settings.jwt.jwks_url
        assert url is not None
        client = self._client or httpx.AsyncClient()
        try:
            r = await client.get(url, timeout=10.0)
            r.raise_for_status()
            self._load_jwks(r.json())
        except (httpx.HTTPError, ValueError, jwt.PyJWTError) as exc:
            log.warning("auth: JWKS fetch from %s failed: %s", url, exc)
        finally:
            if client is not self._client:
                await client.aclose()

    def _load_jwks(self, doc: dict[str, Any]) -> None:
        self._jwks = jwt.PyJWKSet.from_dict(doc)

    def _reload_keys(self) -> None:
        path = self.settings.api_keys_file
        if path is None:
            return
        mtime = path.stat().st_mtime
        if mtime == self._file_mtime:
            return
        self._file_keys = {k.sha256.lower(): k for k in load_keys(path)}
        self._file_mtime = mtime
        log.info("auth: %d API keys loaded from %s", len(self._file_keys), path)

    # -- the core -----------------------------------------------------------------------------------
    def authenticate(self, headers: Mapping[str, str]) -> Principal:
        """The caller of a request with ``headers`` (lower-case names); raises ``Unauthenticated``."""
        s = self.settings
        if not s.enabled:
            return ANONYMOUS
        token = credential(headers)
        if token is None:
            raise Unauthenticated("Missing credentials: send 'Authorization: Bearer <key or token>'.",
                                  "missing_credentials")
        if s.mode in ("jwt", "both") and token.count(".") == 2:
            return self._jwt(token)
        if s.mode in ("api_key", "both"):
            h = key_hash(token)
            k = self._static.get(h) or self._file_keys.get(h)
            if k is not None:
                return Principal(f"key:{k.name or h[:8]}", k.tenant, k.role, "api_key")
        raise Unauthenticated("Invalid credentials.")

    def _jwt(self, token: str) -> Principal:
        s = self.settings.jwt
        now = self._now()
        ck = key_hash(token)
        hit = self._verified.get(ck)
        if hit is not None and hit[0] > now:
            return hit[1]
        if self._jwks is None:
            raise Unauthenticated("No signing keys are loaded; the token cannot be verified.", "invalid_token")
        try:
            kid = jwt.get_unverified_header(token).get("kid")
            keys = [k for k in self._jwks.keys if kid is None or k.key_id == kid]
            if not keys:
                raise Unauthenticated("The token's signing key is unknown.", "invalid_token")
            claims: dict[str, Any] = jwt.decode(
                token, keys[0], algorithms=s.algorithms, audience=s.audience, issuer=s.issuer, leeway=s.leeway_s,
                options={"require": ["exp"]})
        except jwt.PyJWTError as exc:
            raise Unauthenticated(f"Invalid token: {exc}", "invalid_token") from None
        tenant = _claim(claims, s.tenant_claim)
        tenant = tenant if isinstance(tenant, str) else ""
        principal = Principal(f"jwt:{claims.get('sub', '?')}", tenant, role_of(claims, s), "jwt")
        if s.cache_s > 0 and s.cache_size > 0:
            exp = float(claims["exp"])
            self._verified[ck] = (min(now + s.cache_s, exp), principal)
            while len(self._verified) > s.cache_size:
                self._verified.popitem(last=False)
        return principal

def require(auth: Authenticator, headers: Mapping[str, str], *, proxy: bool = False, operator: bool = False
            ) -> Principal:
    """The HTTP front's check: who is calling (401), and whether they may (403). ``proxy``: an inference
    call, which needs a tenant; ``operator``: an operator-only admin call."""
    p = auth.authenticate(headers)
    if p.role == "none":
        raise Forbidden(f"{p.name} has no role in kvgate.", code="no_role")
    if operator and not p.operator:
        raise Forbidden(f"{p.name} is not an operator.", code="operator_required")
    if proxy and auth.settings.enabled and not p.tenant:
        raise Forbidden(f"{p.name} is bound to no tenant and cannot make inference calls.", code="no_tenant")
    return p
