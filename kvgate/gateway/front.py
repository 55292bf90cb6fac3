"""A front door that speaks another protocol over the chat pipeline (OpenAI Responses, Anthropic Messages).

The proxy runs one pipeline for every door: prepare → route and send → relay → record, on a Chat
Completions body. A ``Front`` translates at both ends and nowhere else: its request into a chat body
(``to_chat``), the worker's chat answer back into its own protocol (``from_json`` for a whole answer,
``from_stream`` for SSE), and kvgate's errors into its own error shape. So the prompt kvgate hashes is
the one the worker's chat template renders — the tokens the engine computes — whatever door the client
used, and canonical history, restoration and the conversation record work unchanged.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import Any, Protocol

from kvgate.errors import ApiError
from kvgate.gateway.exchange import Prepared


class Front(Protocol):
    name: str
    """The door's name in metrics and traces (``responses``, ``messages``)."""
    retain_s: float | None
    """Set by ``to_chat``: how long the request asked for its KV to be kept (``session/retention.py``), carried
    on the prepared request beside the body, never in it: a field of the body a chat client could set too."""

    async def to_chat(self, body: dict[str, Any], headers: Mapping[str, str], tenant: str | None
                      ) -> dict[str, Any]:
        """The chat body for this request; raises ``ApiError`` (answered in this protocol's shape).
        ``tenant``: the caller's (auth on) or the tenant header's, for lookups of stored state."""
        ...

    async def from_json(self, chat: dict[str, Any], prepared: Prepared) -> dict[str, Any]:
        """A whole 2xx chat answer in this protocol (and stored, for a door that keeps answers)."""
        ...

    def from_stream(self, chunks: AsyncIterator[bytes], prepared: Prepared) -> AsyncIterator[bytes]:
        """The chat SSE stream as this protocol's stream (and stored once it ends, for a door that keeps
        answers). ``chunks`` are whole SSE events, as the relay sends them to a chat client."""
        ...

    def error(self, status: int, err: ApiError | dict[str, Any]) -> dict[str, Any]:
        """An error body in this protocol's shape: from kvgate's own error, or a worker's OpenAI-shaped
        error body."""
        ...
