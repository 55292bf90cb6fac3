"""Who may call the endpoint picker. The ext_proc port is a control surface: its answers carry the pick,
the canonical body and (to the data plane only) the workers' credential. Two ways to authenticate the
caller, alone or together:

- a shared secret Envoy sends on every ext_proc stream as gRPC initial metadata
  (``grpc_service.initial_metadata``: ``authorization: Bearer <token>``); a stream without a valid one
  ends with UNAUTHENTICATED before anything is read;
- mutual TLS: the port serves TLS (``tls_cert_file`` / ``tls_key_file``, re-read when they change, as
  cert-manager rotates a mounted Secret) and, with ``client_ca_file``, the handshake requires a client
  certificate signed by that CA (``client_names``: and naming one of these in its SAN or CN).

A stream that passed every configured check is the data plane's: only its answers carry
``auth.worker_api_key``. With no caller authentication the key is never sent; a picker configured with
a workers' key and no caller authentication refuses to start, unless ``allow_unauthenticated`` says
the network is the boundary (docs/epp.md, "Who may call the picker")."""

from __future__ import annotations

import hmac
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from kvgate.settings.epp import TOKEN_MIN_CHARS, EppAuthSettings, check_startup

__all__ = ["TOKEN_MIN_CHARS", "EppAuthSettings", "check_startup"]


# -- TLS ------------------------------------------------------------------------------------------
@dataclass
class _Files:
    """The PEM files and their modification times, re-read when one changes."""

    settings: EppAuthSettings
    stamp: tuple[float, ...] = ()

    def paths(self) -> list[str]:
        s = self.settings
        return [p for p in (s.tls_cert_file, s.tls_key_file, s.client_ca_file) if p is not None]

    def changed(self) -> bool:
        try:
            stamp = tuple(os.stat(p).st_mtime_ns for p in self.paths())
        except OSError:  # mid-rotation (a Secret's symlink swap): keep serving the certificates loaded
            return False
        if stamp == self.stamp:
            return False
        self.stamp = stamp
        return True

    def configuration(self) -> Any:
        s = self.settings
        assert s.tls_cert_file is not None and s.tls_key_file is not None
        key, chain = Path(s.tls_key_file).read_bytes(), Path(s.tls_cert_file).read_bytes()
        ca = Path(s.client_ca_file).read_bytes() if s.client_ca_file is not None else None
        return grpc.ssl_server_certificate_configuration([(key, chain)], root_certificates=ca)


def server_credentials(epp: EppAuthSettings) -> grpc.ServerCredentials | None:
    """TLS credentials for the ext_proc port (None: plaintext). Read now, so a missing or unreadable file
    stops the start-up; then re-read on a new handshake after a file changed."""
    if epp.tls_cert_file is None:
        return None
    files = _Files(epp)
    files.changed()
    initial = files.configuration()

    def fetch() -> Any:
        if not files.changed():
            return None  # gRPC keeps the current configuration
        try:
            return files.configuration()
        except OSError:
            return None

    return grpc.dynamic_ssl_server_credentials(initial, fetch,
                                               require_client_authentication=epp.client_ca_file is not None)


# -- per stream -----------------------------------------------------------------------------------
class Refused(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def _bearer(metadata: Iterable[tuple[str, Any]]) -> bytes | None:
    for k, v in metadata:
        if k.lower() == "authorization" and isinstance(v, str):
            scheme, _, token = v.strip().partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip().encode()
    return None


def _names(auth_context: Mapping[str, Iterable[bytes]]) -> set[str]:
    return {v.decode(errors="replace") for k in ("x509_subject_alternative_name", "x509_common_name")
            for v in auth_context.get(k, [])}


def authenticate(epp: EppAuthSettings, metadata: Iterable[tuple[str, Any]],
                 auth_context: Mapping[str, Iterable[bytes]]) -> bool:
    """Whether this stream is the authenticated data plane's. Raises ``Refused`` when a configured check
    fails; False when none is configured (the stream is served, never with the workers' key)."""
    if epp.client_ca_file is not None:
        # The handshake already required the certificate; checked again so that a transport set up
        # otherwise (a plaintext port by mistake) can never pass for mutual TLS.
        if not list(auth_context.get("x509_pem_cert", ())):
            raise Refused(grpc.StatusCode.UNAUTHENTICATED, "the endpoint picker requires a client certificate")
        if epp.client_names and not _names(auth_context) & set(epp.client_names):
            raise Refused(grpc.StatusCode.PERMISSION_DENIED,
                          "the client certificate names no caller the endpoint picker allows")
    if epp.tokens:
        got = _bearer(metadata)
        # Every token compared in constant time, none skipped: the time says nothing of which matched.
        ok = [hmac.compare_digest(got or b"", t.get_secret_value().encode()) for t in epp.tokens]
        if got is None or not any(ok):
            raise Refused(grpc.StatusCode.UNAUTHENTICATED, "the endpoint picker requires its caller token "
                          "(authorization: Bearer ... in the ext_proc grpc_service initial_metadata)")
    return epp.authenticates
