"""``epp_auth`` in the gateway settings: who may call the endpoint picker (enforced by kvgate/epp/trust.py;
docs/epp.md, "Who may call the picker")."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

TOKEN_MIN_CHARS = 16
"""A shared secret shorter than this is refused: it stands for the workers' key on the wire."""


class EppAuthSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tokens: list[SecretStr] = Field(default_factory=list)
    """Shared secrets, any one of which authenticates a stream (two while rotating one); Envoy sends it
    as ``authorization: Bearer <token>`` initial metadata on its ext_proc gRPC service."""
    tls_cert_file: str | None = None
    """PEM certificate chain the ext_proc port serves TLS with (with ``tls_key_file``); None: plaintext."""
    tls_key_file: str | None = None
    client_ca_file: str | None = None
    """PEM CA bundle; set, the TLS handshake requires a client certificate it signed (mutual TLS)."""
    client_names: list[str] = Field(default_factory=list)
    """With ``client_ca_file``: the client certificate must name one of these (a DNS or URI SAN, e.g. a
    SPIFFE id, or its CN). Empty: any certificate the CA signed."""
    allow_unauthenticated: bool = False
    """Callers are not authenticated by kvgate (a mesh's AuthorizationPolicy or a NetworkPolicy is the
    boundary): the picker starts with ``auth.worker_api_key`` set, and never sends it."""

    @model_validator(mode="after")
    def _consistent(self) -> EppAuthSettings:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("epp_auth: tls_cert_file and tls_key_file go together")
        if self.client_ca_file is not None and self.tls_cert_file is None:
            raise ValueError("epp_auth: client_ca_file (mutual TLS) needs tls_cert_file and tls_key_file")
        if self.client_names and self.client_ca_file is None:
            raise ValueError("epp_auth: client_names needs client_ca_file")
        if any(len(t.get_secret_value()) < TOKEN_MIN_CHARS for t in self.tokens):
            raise ValueError(f"epp_auth: a token must have at least {TOKEN_MIN_CHARS} characters")
        if self.allow_unauthenticated and self.authenticates:
            raise ValueError("epp_auth: allow_unauthenticated contradicts tokens / client_ca_file")
        return self

    @property
    def authenticates(self) -> bool:
        """Every stream's caller is authenticated (a token, a client certificate, or both)."""
        return bool(self.tokens) or self.client_ca_file is not None


def check_startup(epp: EppAuthSettings, worker_key: SecretStr | None, epp_port: int | None) -> None:
    """A picker that holds the workers' key must know who it hands it to, or be told not to hand it out."""
    if epp_port is None or worker_key is None or epp.authenticates or epp.allow_unauthenticated:
        return
    raise ValueError("epp_port with auth.worker_api_key needs the picker's callers authenticated "
                     "(epp_auth.tokens and/or epp_auth.client_ca_file), or epp_auth.allow_unauthenticated: true "
                     "(the workers' key is then never sent through Envoy); docs/epp.md")
