"""``hostile`` in the gateway settings: the limits that keep one client's hostile or oversized input from
hurting others (enforced by kvgate/gateway/inputlimits.py and kvgate/connections.py; docs/hostile-input.md)."""

from __future__ import annotations

from pydantic import BaseModel, Field

from kvgate.safejson import JsonLimits


class ConnectionLimits(BaseModel):
    """``hostile.connections``: what one TCP connection may hold of the server (kvgate/connections.py).
    The defaults follow Envoy's and Go's: a client slower than these is not one a gateway serves."""

    model_config = {"extra": "forbid"}

    header_timeout_s: float = Field(10.0, gt=0)
    """From a request's first byte to the end of its headers (Go's ``ReadHeaderTimeout``, Envoy's
    ``request_headers_timeout``); a connection still sending headers then gets 408 and is closed."""
    keep_alive_timeout_s: float = Field(5.0, gt=0)
    """A connection with no request under way (new, or between keep-alive requests) is closed after this
    long; uvicorn's ``timeout_keep_alive``, which alone starts only after a first response."""
    max_header_bytes: int = Field(64 * 1024, ge=1024)
    """Request line and headers; over it, 431 before any more is read (Envoy: 60 KiB, nginx: 32 KiB)."""
    max_connections: int | None = Field(None, ge=1)
    """Open client connections; None: the open-file limit less ``fd_reserve``. Over it, the longest-idle
    connection is closed to make room; with none idle, a new one gets only /health and /ready, else 503."""
    fd_reserve: int | None = Field(None, ge=0)
    """File descriptors kept for what is not a client connection (workers, Redis, KV event sockets, logs,
    the probes' own connections); None: a quarter of the open-file limit, at least 64."""


class HostileSettings(BaseModel):
    """``hostile`` in the gateway settings."""

    model_config = {"extra": "forbid"}

    json_limits: JsonLimits = Field(default_factory=JsonLimits)
    connections: ConnectionLimits = Field(default_factory=ConnectionLimits)
    max_prompt_tokens: int | None = Field(None, ge=16)
    """A prompt over this many tokens is refused (400 ``context_length_exceeded``) before it is sent.
    None: each model's context length as its workers report it (``max_model_len`` in vLLM's /v1/models,
    SGLang's /get_model_info), else the local tokenizer's ``model_max_length``; no limit if neither."""
    inline_prompt_chars: int = Field(16_384, ge=0)
    """Prompts up to this many characters are rendered and tokenized on the event loop (cheaper than a
    thread hop); longer ones in a worker thread, so /health and other requests are not held up."""
