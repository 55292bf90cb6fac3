"""Admission of one request, on the event loop: its tenant's quota (the shared store), then a slot of its
model's fleet (this replica's fair queue). A ``Ticket`` holds both until the request ends.

Refusals are ``ApiError``s: 429 over a tenant limit, 503 when the queue is full or the wait too long,
each with ``Retry-After``."""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from kvgate.admission.quota import OK, Quota, Verdict, ratelimit_headers, retry_after_header
from kvgate.admission.settings import AdmissionSettings, Priority
from kvgate.admission.slots import SlotPool
from kvgate.admission.store import QuotaStore, QuotaStoreError
from kvgate.errors import ApiError, BadRequest, ServiceUnavailable
from kvgate.tasks import cancel_and_wait, stopping

log = logging.getLogger(__name__)

_TYPES = {"max_concurrent": "concurrent_requests", "requests_per_minute": "requests",
          "tokens_per_minute": "tokens"}
_WHAT = {"max_concurrent": "concurrent requests", "requests_per_minute": "requests per minute (RPM)",
         "tokens_per_minute": "prompt tokens per minute (TPM)"}


class RateLimited(ApiError):
    """429 in OpenAI's shape: ``type`` names the limit (``requests``, ``tokens``, as OpenAI's do, or
    ``concurrent_requests``), ``code`` is ``rate_limit_exceeded``."""

    status = 429
    type = "requests"


def refusal(tenant: str, v: Verdict, tokens: int, fallback_s: int) -> RateLimited:
    assert v.limit is not None
    after = retry_after_header(v, fallback_s)
    what = _WHAT[v.limit]
    asked = f"Requested {tokens}. " if v.limit == "tokens_per_minute" else ""
    if after is None:
        msg = (f"Request too large for tenant `{tenant}` on {what}: Limit {v.limit_value}, {asked}"
               "Send fewer tokens.")
    else:
        msg = f"Rate limit reached for tenant `{tenant}` on {what}: Limit {v.limit_value}. {asked}" \
              f"Please try again in {after}s."
    err = RateLimited(msg, code="rate_limit_exceeded", headers={"Retry-After": after} if after else None)
    err.type = _TYPES[v.limit]
    return err


def parse_priority(value: str | None, default: Priority, header: str) -> Priority:
    if value is None or not value.strip():
        return default
    v = value.strip().lower()
    if v == "interactive":
        return "interactive"
    if v == "batch":
        return "batch"
    raise BadRequest(f"`{header}` must be `interactive` or `batch`, got `{value[:40]}`.", param=header,
                     code="invalid_priority")


@dataclass(eq=False)
class _Waiter:
    fut: asyncio.Future[None]
    tenant: str


@dataclass
class Ticket:
    """What an admitted request holds; ``release`` (idempotent) gives it back."""

    gate: Admission
    tenant: str
    model: str
    priority: Priority
    lease: str | None
    slot: bool
    verdict: Verdict = OK
    """What the tenant's rate limits had left when it was admitted (the ``x-ratelimit-*`` headers)."""
    estimated: int = 0
    """The prompt tokens it was admitted with, estimated from its text (``prompt`` settles them)."""
    released: bool = field(default=False)

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        self.gate._release(self)

    def headers(self) -> dict[str, str]:
        return ratelimit_headers(self.verdict)

    def prompt(self, tokens: int) -> None:
        """The prompt's tokens, counted: what the estimate missed (or took too much) is settled with the
        tenant's tokens per minute; a prompt larger than a whole minute's tokens is refused (429, a retry
        never succeeds). The caller releases the ticket of a refused request."""
        self.gate._settle_prompt(self, tokens)

    def completed(self, completion_tokens: int) -> None:
        """The response's completion tokens, charged to the tenant's tokens per minute now that they are
        known (off the request's path)."""
        self.gate._charge_completion(self, completion_tokens)


class Admission:
    def __init__(self, settings: AdmissionSettings, store: QuotaStore, capacity: Callable[[str], int | None],
                 retry_after_s: int, now: Callable[[], float] = time.monotonic) -> None:
        """``capacity``: a model's slots on this replica now (its healthy workers' engine caps, less what other
        replicas run there; None: no cap known, nobody waits)."""
        self.settings = settings
        self.store = store
        self.capacity = capacity
        self.retry_after_s = retry_after_s
        self.now = now
        self._pools: dict[str, SlotPool[_Waiter]] = {}
        self._held: dict[str, set[str]] = {}
        """Leases this replica holds, by tenant: renewed until released."""
        self._tasks: set[asyncio.Task[None]] = set()
        self._loops: list[asyncio.Task[None]] = []
        self._replica = uuid.uuid4().hex[:8]
        self.rejected: dict[str, int] = {}
        """Refusals by reason (the limit, ``queue_full``, ``queue_timeout``): /metrics and the bench read it."""

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._loops = [loop.create_task(self._renew_loop(), name="admission-renew"),
                       loop.create_task(self._grant_loop(), name="admission-grant")]

    async def aclose(self) -> None:
        for t in self._loops:
            await cancel_and_wait(t)
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.store.close()

    def priority(self, headers: Mapping[str, str]) -> Priority:
        s = self.settings
        return parse_priority(headers.get(s.priority_header), s.default_priority, s.priority_header)

    def queued(self, model: str | None = None) -> int:
        return sum(len(p) for m, p in self._pools.items() if model is None or m == model)

    def models(self) -> list[str]:
        return sorted(self._pools)

    def busy(self, model: str) -> int:
        p = self._pools.get(model)
        return 0 if p is None else p.busy

    def pool(self, model: str) -> SlotPool[_Waiter]:
        p = self._pools.get(model)
        if p is None:
            s = self.settings
            p = self._pools[model] = SlotPool(s.queue_size, s.share_window_s if s.fair_share else None)
        return p

    async def admit(self, tenant: str, model: str, priority: Priority, tokens: int) -> Ticket:
        s = self.settings
        limits = s.limits_for(tenant)
        pool = self.pool(model)
        cap = self.capacity(model)
        if cap is not None and pool.busy >= cap and pool.full:
            # Refused before the quota is charged: nothing to give back.
            raise self._unavailable("queue_full", f"The admission queue for model `{model}` is full.")
        lease, verdict = await self._quota(tenant, limits.max_concurrent, limits.requests_per_minute,
                                           limits.tokens_per_minute, tokens)
        ticket = Ticket(self, tenant, model, priority, lease, slot=False, verdict=verdict, estimated=tokens)
        pool.arrive(tenant, limits.weight, self.now())
        try:
            await self._take_slot(pool, tenant, priority, model)
        except BaseException:
            ticket.release()
            raise
        ticket.slot = True
        return ticket

    async def _quota(self, tenant: str, max_concurrent: int | None, rpm: int | None, tpm: int | None, tokens: int
                     ) -> tuple[str | None, Verdict]:
        quota = Quota(max_concurrent, rpm, tpm)
        if quota.unlimited:
            return None, OK
        lease = f"{self._replica}:{uuid.uuid4().hex}" if quota.max_concurrent is not None else None
        try:
            verdict = await self.store.admit(tenant, quota, tokens, lease or "", self.settings.lease_ttl_s)
        except QuotaStoreError as exc:
            # The shared store is down: serving unmetered beats refusing everyone (docs/admission.md).
            log.warning("admission store: %s; admitting unmetered", exc)
            return None, OK
        if not verdict.ok:
            assert verdict.limit is not None
            self._count(verdict.limit)
            raise refusal(tenant, verdict, tokens, self.retry_after_s)
        if lease is not None:
            self._held.setdefault(tenant, set()).add(lease)
        return lease, verdict

    async def _take_slot(self, pool: SlotPool[_Waiter], tenant: str, priority: Priority, model: str) -> None:
        now = self.now()
        if pool.try_take(tenant, priority, self.capacity(model), now):
            return
        w = _Waiter(asyncio.get_running_loop().create_future(), tenant)
        if not pool.push(tenant, priority, w):
            raise self._unavailable("queue_full", f"The admission queue for model `{model}` is full.")
        self._grant(model)  # capacity may have grown (a worker came back) since try_take
        try:
            await asyncio.wait_for(asyncio.shield(w.fut), self.settings.max_queue_wait_s)
        except TimeoutError:
            if not pool.remove(tenant, w, self.now()) and w.fut.done():
                return  # granted as the wait ran out: keep it
            raise self._unavailable("queue_timeout", f"Waited {self.settings.max_queue_wait_s:g}s for a free "
                                    f"slot of model `{model}`.") from None
        except asyncio.CancelledError:
            # The request went away while waiting: a slot granted meanwhile goes to the next waiter.
            if not pool.remove(tenant, w, self.now()) and w.fut.done() and not w.fut.cancelled():
                pool.release(tenant, self.now())
                self._grant(model)
            w.fut.cancel()
            raise

    def _grant(self, model: str) -> None:
        pool = self._pools.get(model)
        if pool is None or not len(pool):
            return
        gone = False
        for w in pool.grant(self.capacity(model), self.now()):
            if not w.fut.done():
                w.fut.set_result(None)
            else:  # its request gave up meanwhile: the slot goes back
                pool.release(w.tenant, self.now())
                gone = True
        if gone:
            self._grant(model)

    def _unavailable(self, reason: str, message: str) -> ServiceUnavailable:
        self._count(reason)
        return ServiceUnavailable(message + " Retry later.", code=reason,
                                  headers={"Retry-After": str(max(1, self.retry_after_s))})

    def _count(self, reason: str) -> None:
        self.rejected[reason] = self.rejected.get(reason, 0) + 1

    def _release(self, t: Ticket) -> None:
        if t.slot:
            self._pools[t.model].release(t.tenant, self.now())
            self._grant(t.model)
        if t.lease is not None:
            held = self._held.get(t.tenant)
            if held is not None:
                held.discard(t.lease)
                if not held:
                    del self._held[t.tenant]
            # Released off the request's path (a stream's end may be a cancellation): the lease's expiry
            # covers a release that fails.
            self._spawn(self._release_lease(t.tenant, t.lease))

    def _charge_completion(self, t: Ticket, completion_tokens: int) -> None:
        tpm = self.settings.limits_for(t.tenant).tokens_per_minute
        if tpm is not None and completion_tokens > 0:
            self._spawn(self._charge(t.tenant, tpm, completion_tokens))

    def _settle_prompt(self, t: Ticket, tokens: int) -> None:
        tpm = self.settings.limits_for(t.tenant).tokens_per_minute
        if tpm is None:
            return
        if tokens > tpm:
            self._spawn(self._charge(t.tenant, tpm, -t.estimated))  # nothing of it is spent
            self._count("tokens_per_minute")
            raise refusal(t.tenant, Verdict(False, "tokens_per_minute", tpm, math.inf), tokens, self.retry_after_s)
        if tokens != t.estimated:
            self._spawn(self._charge(t.tenant, tpm, tokens - t.estimated))
            v = t.verdict.tokens
            if v is not None:
                t.verdict = replace(t.verdict, tokens=replace(v, remaining=v.remaining - (tokens - t.estimated)))
            t.estimated = tokens

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _charge(self, tenant: str, tpm: int, tokens: int) -> None:
        try:
            await self.store.charge(tenant, "tokens", tpm, tokens)
        except QuotaStoreError as exc:
            log.warning("admission: completion tokens not charged: %s", exc)

    async def _release_lease(self, tenant: str, lease: str) -> None:
        try:
            await self.store.release(tenant, lease)
        except QuotaStoreError as exc:
            log.warning("admission lease not released (it expires): %s", exc)

    async def _renew_loop(self) -> None:
        period = self.settings.lease_ttl_s / 3
        while not stopping():
            await asyncio.sleep(period)
            held = {t: set(ls) for t, ls in self._held.items()}
            if not held:
                continue
            try:
                await self.store.renew(held, self.settings.lease_ttl_s)
            except QuotaStoreError as exc:
                log.warning("admission leases not renewed: %s", exc)

    async def _grant_loop(self) -> None:
        # Capacity also grows without a release here: a worker joins, other replicas' requests end, a cap
        # is learned higher. Waiters are looked at again a few times a second.
        while not stopping():
            await asyncio.sleep(GRANT_TICK_S)
            for model in list(self._pools):
                self._grant(model)


GRANT_TICK_S = 0.2
