"""Admission of one request, on the event loop: its tenant's quota (the shared store), then a slot of its
model's fleet (this replica's fair queue). A ``Ticket`` holds both until the request ends.

Refusals are ``ApiError``s: 429 over a tenant limit, 503 when the queue is full or the wait too long,
each with ``Retry-After``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from kvgate.admission.fairqueue import FairQueue
from kvgate.admission.quota import Quota, Verdict, retry_after_header
from kvgate.admission.settings import AdmissionSettings, Priority
from kvgate.admission.store import QuotaStore, QuotaStoreError
from kvgate.errors import ApiError, BadRequest, ServiceUnavailable

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


@dataclass
class _Waiter:
    fut: asyncio.Future[None]


@dataclass
class Slots:
    """One model's slots on this replica: how many are taken, and who waits for one."""

    queue: FairQueue[_Waiter]
    busy: int = 0

    def dispatch(self, capacity: int) -> None:
        """Hand free slots to the next waiters in fair order."""
        while self.busy < capacity:
            w = self.queue.pop()
            if w is None:
                return
            if not w.fut.done():
                self.busy += 1
                w.fut.set_result(None)


@dataclass
class Ticket:
    """What an admitted request holds; ``release`` (idempotent) gives it back."""

    gate: Admission
    tenant: str
    model: str
    priority: Priority
    lease: str | None
    slot: bool
    released: bool = field(default=False)

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        self.gate._release(self)


class Admission:
    def __init__(self, settings: AdmissionSettings, store: QuotaStore, capacity: Callable[[str], int],
                 retry_after_s: int) -> None:
        """``capacity``: a model's slots now (``worker_slots`` × its healthy workers)."""
        self.settings = settings
        self.store = store
        self.capacity = capacity
        self.retry_after_s = retry_after_s
        self._slots: dict[str, Slots] = {}
        self._held: dict[str, set[str]] = {}
        """Leases this replica holds, by tenant: renewed until released."""
        self._tasks: set[asyncio.Task[None]] = set()
        self._renewer: asyncio.Task[None] | None = None
        self._replica = uuid.uuid4().hex[:8]
        self.rejected: dict[str, int] = {}
        """Refusals by reason (the limit, ``queue_full``, ``queue_timeout``): /metrics and the bench read it."""

    def start(self) -> None:
        self._renewer = asyncio.get_running_loop().create_task(self._renew_loop(), name="admission-renew")

    async def aclose(self) -> None:
        if self._renewer is not None:
            self._renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._renewer
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.store.close()

    def priority(self, headers: Mapping[str, str]) -> Priority:
        s = self.settings
        return parse_priority(headers.get(s.priority_header), s.default_priority, s.priority_header)

    def queued(self, model: str | None = None) -> int:
        return sum(len(s.queue) for m, s in self._slots.items() if model is None or m == model)

    def models(self) -> list[str]:
        return sorted(self._slots)

    def busy(self, model: str) -> int:
        s = self._slots.get(model)
        return 0 if s is None else s.busy

    async def admit(self, tenant: str, model: str, priority: Priority, tokens: int) -> Ticket:
        s = self.settings
        limits = s.limits_for(tenant)
        slots = self._slots_of(model) if s.worker_slots is not None else None
        cap = self.capacity(model) if slots is not None else 0
        if slots is not None and cap > 0 and slots.busy >= cap and slots.queue.full:
            # Refused before the quota is charged: nothing to give back.
            raise self._unavailable("queue_full", f"The admission queue for model `{model}` is full.")
        lease = None
        quota = Quota(limits.max_concurrent, limits.requests_per_minute, limits.tokens_per_minute)
        if not quota.unlimited:
            lease = f"{self._replica}:{uuid.uuid4().hex}" if quota.max_concurrent is not None else None
            try:
                verdict = await self.store.admit(tenant, quota, tokens, lease or "", s.lease_ttl_s)
            except QuotaStoreError as exc:
                # The shared store is down: serving unmetered beats refusing everyone (docs/admission.md).
                log.warning("admission store: %s; admitting unmetered", exc)
                verdict, lease = Verdict(True), None
            if not verdict.ok:
                assert verdict.limit is not None
                self._count(verdict.limit)
                raise refusal(tenant, verdict, tokens, self.retry_after_s)
            if lease is not None:
                self._held.setdefault(tenant, set()).add(lease)
        ticket = Ticket(self, tenant, model, priority, lease, slot=False)
        cap = self.capacity(model) if slots is not None else 0  # again: the store's answer took a while
        if slots is None or cap <= 0:  # no slot limit, or no healthy worker: the sender answers that
            return ticket
        try:
            await self._take_slot(slots, cap, tenant, limits.weight, priority, model)
        except BaseException:
            ticket.release()
            raise
        ticket.slot = True
        return ticket

    async def _take_slot(self, slots: Slots, cap: int, tenant: str, weight: float, priority: Priority,
                         model: str) -> None:
        if slots.busy < cap and not len(slots.queue):
            slots.busy += 1
            return
        w = _Waiter(asyncio.get_running_loop().create_future())
        if not slots.queue.push(tenant, weight, priority, w):
            raise self._unavailable("queue_full", f"The admission queue for model `{model}` is full.")
        slots.dispatch(self.capacity(model))  # capacity may have grown (a worker came back)
        try:
            await asyncio.wait_for(asyncio.shield(w.fut), self.settings.max_queue_wait_s)
        except TimeoutError:
            if not slots.queue.remove(tenant, w) and w.fut.done():
                return  # granted as the wait ran out: keep it
            raise self._unavailable("queue_timeout", f"Waited {self.settings.max_queue_wait_s:g}s for a free "
                                    f"slot of model `{model}`.") from None
        except asyncio.CancelledError:
            # The request went away while waiting: a slot granted meanwhile goes to the next waiter.
            if not slots.queue.remove(tenant, w) and w.fut.done() and not w.fut.cancelled():
                slots.busy -= 1
                slots.dispatch(self.capacity(model))
            w.fut.cancel()
            raise

    def _unavailable(self, reason: str, message: str) -> ServiceUnavailable:
        self._count(reason)
        return ServiceUnavailable(message + " Retry later.", code=reason,
                                  headers={"Retry-After": str(max(1, self.retry_after_s))})

    def _count(self, reason: str) -> None:
        self.rejected[reason] = self.rejected.get(reason, 0) + 1

    def _slots_of(self, model: str) -> Slots:
        slots = self._slots.get(model)
        if slots is None:
            slots = self._slots[model] = Slots(FairQueue(self.settings.queue_size))
        return slots

    def _release(self, t: Ticket) -> None:
        if t.slot:
            slots = self._slots[t.model]
            slots.busy -= 1
            slots.dispatch(self.capacity(t.model))
        if t.lease is not None:
            held = self._held.get(t.tenant)
            if held is not None:
                held.discard(t.lease)
                if not held:
                    del self._held[t.tenant]
            # Released off the request's path (a stream's end may be a cancellation): the lease's expiry
            # covers a release that fails.
            task = asyncio.get_running_loop().create_task(self._release_lease(t.tenant, t.lease))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _release_lease(self, tenant: str, lease: str) -> None:
        try:
            await self.store.release(tenant, lease)
        except QuotaStoreError as exc:
            log.warning("admission lease not released (it expires): %s", exc)

    async def _renew_loop(self) -> None:
        period = self.settings.lease_ttl_s / 3
        while True:
            await asyncio.sleep(period)
            held = {t: set(ls) for t, ls in self._held.items()}
            if not held:
                continue
            try:
                await self.store.renew(held, self.settings.lease_ttl_s)
            except QuotaStoreError as exc:
                log.warning("admission leases not renewed: %s", exc)

