"""``auth`` in the gateway settings: API keys, JWTs, roles and the per-tenant cache salt's secret
(enforced by kvgate/gateway/auth.py; docs/security.md). Settings only: the config imports no front."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

Role = Literal["tenant", "operator", "none"]


class ApiKey(BaseModel):
    """One API key, by its hash: ``sha256`` of the key's UTF-8 bytes, hex (``printf %s KEY | sha256sum``)."""

    model_config = ConfigDict(extra="forbid")

    sha256: str = Field(pattern=r"^[0-9a-fA-F]{64}$")
    tenant: str = Field("", pattern=r"^[A-Za-z0-9._:@+=-]{0,256}$")
    role: Role = "tenant"
    name: str = ""
    """Who holds it, for logs and the policy change log (default: ``key:<first 8 hex of the hash>``)."""


class JwtSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    issuer: str | None = None
    """Required ``iss``; None accepts any (not advisable)."""
    audience: str | None = None
    """Required ``aud``; None: tokens carrying an ``aud`` are refused (PyJWT's rule)."""
    jwks_file: Path | None = None
    """A JWKS document on disk (e.g. a mounted ConfigMap); re-read every ``jwks_refresh_s``."""
    jwks_url: str | None = None
    """A JWKS endpoint (the identity provider's ``jwks_uri``); fetched every ``jwks_refresh_s``."""
    jwks_refresh_s: float = Field(300.0, gt=0)
    algorithms: list[str] = Field(default_factory=lambda: ["RS256", "ES256", "EdDSA"])
    tenant_claim: str = "tenant"
    """The claim naming the tenant (dotted for nested claims: ``org.id``)."""
    role_claim: str = "role"
    """The claim naming the role; a list claim (``roles``) grants the highest role it contains."""
    operator_values: list[str] = Field(default_factory=lambda: ["operator", "kvgate:operator"])
    tenant_values: list[str] = Field(default_factory=lambda: ["tenant", "kvgate:tenant"])
    default_role: Role = "none"
    """The role of a valid token whose role claim is absent or names neither role."""
    leeway_s: float = Field(30.0, ge=0)
    cache_s: float = Field(60.0, ge=0)
    """How long a verified token is kept verified (never past its ``exp``)."""
    cache_size: int = Field(10_000, ge=0)


class AuthSettings(BaseModel):
    """``auth:`` in the gateway settings (env: ``KVGATE_AUTH__MODE``, ...)."""

    model_config = ConfigDict(extra="forbid")

    mode: Literal["off", "api_key", "jwt", "both"] = "off"
    """off: today's behaviour (no credentials, tenant from the tenant header, admin open)."""
    api_keys: list[ApiKey] = Field(default_factory=list)
    api_keys_file: Path | None = None
    """A YAML/JSON list of ``ApiKey`` entries (e.g. a mounted Kubernetes Secret), re-read when it changes."""
    jwt: JwtSettings = Field(default_factory=JwtSettings)
    worker_api_key: SecretStr | None = None
    """Sent to workers as ``Authorization: Bearer`` (vLLM ``--api-key``); the client's own header is never
    forwarded when auth is on."""
    cache_salt_secret: SecretStr | None = None
    """HMAC key of the per-tenant ``cache_salt``. Every gateway replica needs the same one (the salt is
    part of every block hash). Required when auth is on, unless ``cache_salt`` is false."""
    cache_salt: bool = True
    """Inject a per-tenant ``cache_salt`` into proxied bodies when auth is on (vLLM workers)."""
    sharing_groups: dict[str, list[str]] = Field(default_factory=dict)
    """Opt-in cache sharing: group name → tenants. Members share one salt, so one member's cached prefix
    (a platform-wide system prompt) is a hit for the others. A tenant is in at most one group."""

    @model_validator(mode="after")
    def _check(self) -> AuthSettings:
        if self.mode in ("jwt", "both") and not (self.jwt.jwks_file or self.jwt.jwks_url):
            raise ValueError("auth.jwt needs jwks_file or jwks_url when mode is jwt or both")
        if self.mode != "off" and self.cache_salt and self.cache_salt_secret is None:
            raise ValueError("auth.cache_salt_secret is required when auth is on (or set auth.cache_salt: false)")
        seen: dict[str, str] = {}
        for group, members in self.sharing_groups.items():
            for t in members:
                if t in seen:
                    raise ValueError(f"tenant `{t}` is in two sharing groups ({seen[t]}, {group})")
                seen[t] = group
        return self

    @property
    def enabled(self) -> bool:
        return self.mode != "off"
