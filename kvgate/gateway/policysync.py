"""Policy edits fleet-wide: versioned in the shared store, applied by every replica within a poll.

An edit (``PATCH /admin/policy``, gRPC ``UpdatePolicy``) on any replica is validated against the fleet's
latest parameters, written as the next version with a compare-and-set (``kvstore/policy.py``), and only
then swapped in here; a replica that lost the race re-reads and re-validates. Every replica reads the
version every ``poll_s`` (one HGET) and swaps in a newer document whole, so a change sent to one replica
changes the decisions of all of them within a poll, and a replica that starts takes the fleet's current
parameters before it serves (instead of its configuration's, which an edit since start-up overrode).

An edit of a learned tier rate pins it (``policyedit.pin_rates``), so the pin is in the document every
replica applies and the learning on each (``gateway/tierview.py``) leaves the parameter alone.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from typing import Any

from kvgate.errors import ApiError, ServiceUnavailable
from kvgate.gateway.policyedit import OPTIONAL_SECTIONS, PolicyChange, PolicyLog, PolicyTarget, pin_rates, validate
from kvgate.kvstore.conversations import StoreError
from kvgate.kvstore.policy import PolicyDoc, PolicyStore
from kvgate.tasks import cancel_and_wait, stopping

log = logging.getLogger("kvgate.policy")

ATTEMPTS = 8
"""Compare-and-set attempts of one edit (each after re-reading the newer version that beat it)."""


START_ATTEMPTS = 3
"""Reads of the fleet's document before serving; the store down delays a start by at most this many timeouts."""


class PolicySync:
    def __init__(self, store: PolicyStore, target: PolicyTarget, changes: PolicyLog, poll_s: float = 0.25) -> None:
        self.store = store
        self.target = target
        self.changes = changes
        self.poll_s = poll_s
        self.version = 0
        """The fleet version this replica's parameters are (0: its configuration's, no edit yet)."""
        self.rejected = 0
        """Fleet documents this replica could not apply (corrupt, or parameters it does not accept)."""
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        # A read that timed out once (a busy Redis, 0.5 s) would have this replica serve its configuration's
        # parameters, and ignore the operator's pins, for a poll: a few tries, then it starts anyway.
        for attempt in range(START_ATTEMPTS):
            try:
                await self.refresh()
                break
            except StoreError as exc:
                log.warning("policy store at start (try %d of %d): %s", attempt + 1, START_ATTEMPTS, exc)
        self._task = asyncio.create_task(self._poll(), name="kvgate-policy-sync")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)

    async def _poll(self) -> None:
        while not stopping():
            await asyncio.sleep(self.poll_s)
            try:
                await self.refresh()
            except StoreError as exc:
                log.debug("policy poll: %s", exc)
            except Exception:  # one bad document must not stop the poll that brings the next one
                log.exception("policy poll")

    async def refresh(self) -> bytes:
        """Apply the fleet's document if it is newer than ours; returns the token a write must find."""
        got = await self.store.read()
        doc = got.doc
        if got.corrupt:
            self._reject("corrupt document in the policy store (the next edit replaces it)")
        elif doc is not None and doc.version > self.version:
            current = self.target.current()
            sections = {**{k: m().model_dump() for k, m in OPTIONAL_SECTIONS.items() if k in current},
                        **doc.sections}
            try:
                new = validate(current, sections)
            except ApiError as exc:
                self._reject(f"version {doc.version}: {exc.message}")
            else:
                change, _ = PolicyLog.prepare(self.target, sections, doc.who, "fleet", doc.reason, doc.at)
                self.changes.commit(self.target, new, replace(change, version=doc.version))
                self.version = doc.version
                log.info("policy version %d applied (by %s via %s)", doc.version, doc.who, doc.via)
        return got.token

    def _reject(self, why: str) -> None:
        self.rejected += 1
        if self.rejected == 1 or self.rejected % 100 == 0:
            log.warning("policy store: %s", why)

    async def publish(self, changes: Any, who: str, via: str, reason: str = "") -> PolicyChange:
        """Validate ``changes`` against the fleet's latest parameters, write them as the next version, then
        apply them here. 503 when the store cannot be reached: an edit that only one replica made would
        split the fleet's decisions."""
        if "pinned" in self.target.current():
            changes = pin_rates(changes)
        try:
            for _ in range(ATTEMPTS):
                token = await self.refresh()
                change, new = PolicyLog.prepare(self.target, changes, who, via, reason)
                version = self.version + 1
                sections = {k: m.model_dump(mode="json") for k, m in {**self.target.current(), **new}.items()}
                for k, model in OPTIONAL_SECTIONS.items():
                    if sections.get(k) == model().model_dump(mode="json"):
                        del sections[k]
                doc = PolicyDoc(version, sections, who, via, reason, change.at)
                if await self.store.write(token, doc):
                    change = replace(change, version=version)
                    self.changes.commit(self.target, new, change)
                    self.version = version
                    return change
        except StoreError as exc:
            raise ServiceUnavailable(f"The policy store cannot be reached ({exc}); nothing was changed.",
                                     code="policy_store_unavailable") from exc
        raise ServiceUnavailable("Other policy edits kept winning; nothing was changed: retry.",
                                 code="policy_edit_conflict", headers={"Retry-After": "1"})

    def status(self) -> dict[str, Any]:
        return {"version": self.version, "rejected": self.rejected, "poll_s": self.poll_s}
