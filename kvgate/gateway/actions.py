"""The I/O behind the session controller's commands (``gateway/runtime.py``'s ``Actions``): the worker
pool's reservation view and load, LMCache prefetch and L2 pins, the next turn's prefix, and background prefill
requests."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx

from kvgate.config import GatewaySettings
from kvgate.gateway.auth import tenant_salt
from kvgate.gateway.tierview import TierView
from kvgate.gateway.tracing import current_headers
from kvgate.gateway.turns import TurnService
from kvgate.gateway.workers import WorkerPool
from kvgate.router.cost import CostModel, CostParams
from kvgate.router.types import WorkerId
from kvgate.sequences import common_prefix
from kvgate.session.conversation import Conversation

log = logging.getLogger(__name__)


class GatewayActions:
    def __init__(self, settings: GatewaySettings, pool: WorkerPool, tiers: TierView, turns: TurnService,
                 client: httpx.AsyncClient, cost: CostModel) -> None:
        self.settings = settings
        self.pool = pool
        self.tiers = tiers
        self.turns = turns
        self.client = client
        self._cost = cost

    def reserve_locally(self, worker: WorkerId, tokens: int) -> None:
        self.pool.reserve(worker, tokens)

    def set_reserved(self, totals: dict[WorkerId, int]) -> None:
        self.pool.set_reserved(totals)

    async def prefetch(self, conv: Conversation, worker: WorkerId) -> bool:
        if conv.chain is None or not self.tiers.prefetchable(worker):
            return False
        return await self.tiers.prefetch(conv.model, worker, conv.chain.tokens,
                                         tenant_salt(self.settings.auth, conv.tenant))

    async def pin(self, conv: Conversation, *, unpin: bool = False) -> bool:
        """Pin (unpin) the conversation's cached chain in LMCache's L2, under the tenant's salt."""
        if conv.chain is None:
            return False
        return await self.tiers.pin(conv.model, conv.chain.tokens, tenant_salt(self.settings.auth, conv.tenant),
                                    unpin=unpin)

    async def next_prefix(self, conv: Conversation) -> tuple[int, list[int]] | None:
        if conv.chain is None:
            return None
        protocol = self.turns.protocol(conv.model, conv.tenant, None)
        # A template pass over the whole history: beside the event loop.
        prefix = await asyncio.to_thread(self.turns.next_turn_prefix, conv, protocol)
        if prefix is None:
            return None
        return common_prefix(conv.chain.tokens, prefix), prefix

    def worker_load(self, worker: WorkerId) -> tuple[int, float]:
        w = self.pool.get(worker)
        return w.pending_requests, w.kv_usage

    def block_size(self, worker: WorkerId) -> int:
        return self.pool.get(worker).config.block_size

    def cost(self) -> CostParams:
        return self._cost.params

    async def send_prefill(self, model: str, worker: WorkerId, tokens: list[int], tenant: str = "") -> bool:
        """A ``/v1/completions`` request of the prefix's token ids and one output token, counted in the
        worker's queue like any request so routing sees the work it adds. With auth on it carries the
        tenant's salt: unsalted, it would cache blocks the tenant's own (salted) next turn cannot hit."""
        body: dict[str, Any] = {"model": model, "prompt": tokens, "max_tokens": 1, "temperature": 0}
        salt = tenant_salt(self.settings.auth, tenant)
        if salt is not None:
            body["cache_salt"] = salt
        headers = current_headers()
        if self.settings.auth.worker_api_key is not None:
            headers = {**headers, "authorization": f"Bearer {self.settings.auth.worker_api_key.get_secret_value()}"}
        if self.settings.prefill_priority is not None:
            # vLLM serves lower values first, SGLang higher ones: the setting is vLLM's sense.
            w = self.pool.get(worker)
            body["priority"] = -self.settings.prefill_priority if w.config.engine == "sglang" \
                else self.settings.prefill_priority
        self.pool.acquire(worker, len(tokens))
        try:
            r = await self.client.post(f"{self.pool.get(worker).config.url}/v1/completions", json=body,
                                       headers=headers)
            return r.status_code == 200
        except httpx.HTTPError as exc:
            log.warning("background prefill failed: %r", exc)
            return False
        finally:
            self.pool.release(worker, len(tokens))
