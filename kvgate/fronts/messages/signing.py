"""Signatures on the thinking blocks kvgate returns.

The engine produces no Anthropic signatures, yet Anthropic clients expect one on every thinking block
and send it back unmodified inside a tool loop. kvgate signs the thinking text with a per-deployment
key (HMAC-SHA256) and checks the signature when the block comes back: a block whose text was edited
(or which kvgate never produced) is refused as Anthropic refuses it, so the reasoning that reaches the
engine is the bytes it generated and the prompt prefix still matches its cache.
"""

from __future__ import annotations

import base64
import hashlib
import hmac

PREFIX = "kvg1."
"""Versions the signature format, so a later key or scheme can be told apart from this one."""

DEFAULT_KEY = b"kvgate-thinking-signature-default-key"
"""Used when no secret is configured: edits are still detected, but anyone who reads kvgate's source can
forge a signature (docs/protocols.md says to set ``thinking_signature_secret``)."""


class Signer:
    def __init__(self, key: bytes | None) -> None:
        self._key = key or DEFAULT_KEY

    def sign(self, thinking: str) -> str:
        mac = hmac.new(self._key, b"thinking\x00" + thinking.encode("utf-8", "surrogatepass"), hashlib.sha256)
        return PREFIX + base64.urlsafe_b64encode(mac.digest()).decode().rstrip("=")

    def verify(self, thinking: str, signature: str) -> bool:
        return hmac.compare_digest(self.sign(thinking).encode(), signature.encode("utf-8", "replace"))
