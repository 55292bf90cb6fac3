"""Bounded metric labels and counts for values clients choose: tenants and conversations. Pure, no I/O.

``TenantLabels`` keeps a ``tenant`` label value for the heaviest tenants only (top N by recent prompt
tokens, exponentially decayed); every other tenant is ``(other)`` and a request without one is
``(none)``. Neither can be a tenant id (identity.py allows no parentheses), so nothing aliases them.
Candidates are counted with the Space-Saving algorithm in a fixed number of slots, so a client that
invents a tenant per request costs one slot scan, not memory. The label set changes only at a refresh,
and an outsider displaces a member only when what it certainly sent (its count less what it inherited
from the slot it took) is clearly heavier and a real share of the traffic: a flood of one-request
tenants churns no series.

``ActiveConversations`` counts distinct conversations in a sliding window with HyperLogLog registers:
fixed memory per model whatever the traffic, and no store to scan on a scrape.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator

OTHER = "(other)"
NO_TENANT = "(none)"


class TenantLabels:
    def __init__(self, top_n: int = 10, half_life_s: float = 600.0, refresh_s: float = 30.0,
                 candidates: int | None = None, challenge: float = 1.25, min_share: float = 0.01) -> None:
        self.top_n = max(0, top_n)
        self._cap = max(candidates or 64, 8 * self.top_n, self.top_n + 1)
        self._half_life = half_life_s
        self._refresh_s = refresh_s
        self._challenge = challenge
        self._min_share = min_share
        self._weights: dict[str, float] = {}
        self._inherited: dict[str, float] = {}
        self._total = 0.0
        self._top: set[str] = set()
        self._refreshed: float | None = None

    @property
    def members(self) -> frozenset[str]:
        return frozenset(self._top)

    def label(self, tenant: str) -> str:
        if not tenant:
            return NO_TENANT
        return tenant if tenant in self._top else OTHER

    def observe(self, tenant: str, weight: float, now: float) -> list[str]:
        """Count ``weight`` (prompt tokens) for ``tenant``. Returns the tenants that left the label set
        at this call (a refresh), whose series the caller removes."""
        if tenant:
            w = self._weights
            self._total += weight
            if tenant in w:
                w[tenant] += weight
            elif len(w) < self._cap:
                w[tenant] = weight
                self._inherited[tenant] = 0.0
            else:
                # Space-Saving: the newcomer takes the lightest slot and inherits its count, which bounds
                # how far any tenant's count can be underestimated. Members keep their slots: they leave
                # the label set only when a heavier tenant takes their place at a refresh.
                low = min((t for t in w if t not in self._top), key=w.__getitem__)
                floor = w.pop(low)
                del self._inherited[low]
                w[tenant] = floor + weight
                self._inherited[tenant] = floor
            if len(self._top) < self.top_n:
                self._top.add(tenant)  # a free label: no reason to wait for the refresh
        if self._refreshed is None:
            self._refreshed = now
        if now - self._refreshed < self._refresh_s:
            return []
        return self._refresh(now)

    def _refresh(self, now: float) -> list[str]:
        assert self._refreshed is not None
        decay = 0.5 ** ((now - self._refreshed) / self._half_life)
        self._refreshed = now
        w = self._weights
        for t in w:
            w[t] *= decay
            self._inherited[t] *= decay
        self._total *= decay
        sure = {t: w[t] - self._inherited[t] for t in w}
        keep = {t for t in self._top if t in w}
        outsiders = sorted((t for t in w if t not in keep and sure[t] >= self._min_share * self._total),
                           key=sure.__getitem__, reverse=True)
        while outsiders and len(keep) < self.top_n:
            keep.add(outsiders.pop(0))
        for t in outsiders:  # heaviest first: stop at the first that does not clearly beat the lightest member
            weakest = min(keep, key=w.__getitem__, default=None)
            if weakest is None or sure[t] <= self._challenge * w[weakest]:
                break
            keep.remove(weakest)
            keep.add(t)
        gone = sorted(self._top - keep)
        self._top = keep
        return gone


class _Sketch:
    """HyperLogLog registers for one window slot."""

    __slots__ = ("epoch", "regs")

    def __init__(self, m: int) -> None:
        self.epoch = -1
        self.regs = bytearray(m)


class ActiveConversations:
    """Distinct keys per model seen in the last ``window_s`` seconds (to one slot's granularity)."""

    def __init__(self, window_s: float = 300.0, slots: int = 5, precision: int = 12) -> None:
        self.window_s = window_s
        self._slot_s = window_s / slots
        self._slots = slots
        self._p = precision
        self._m = 1 << precision
        self._sketches: dict[str, list[_Sketch]] = {}

    def models(self) -> Iterator[str]:
        return iter(sorted(self._sketches))

    def add(self, model: str, key: str, now: float) -> None:
        ring = self._sketches.get(model)
        if ring is None:
            ring = self._sketches[model] = [_Sketch(self._m) for _ in range(self._slots)]
        epoch = int(now // self._slot_s)
        s = ring[epoch % self._slots]
        if s.epoch != epoch:
            s.epoch = epoch
            s.regs[:] = bytes(self._m)
        h = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")
        rest_bits = 64 - self._p
        idx, rest = h >> rest_bits, h & ((1 << rest_bits) - 1)
        rank = rest_bits - rest.bit_length() + 1
        if rank > s.regs[idx]:
            s.regs[idx] = rank

    def count(self, model: str, now: float) -> float:
        ring = self._sketches.get(model)
        if ring is None:
            return 0.0
        epoch = int(now // self._slot_s)
        live = [s.regs for s in ring if epoch - self._slots < s.epoch <= epoch]
        if not live:
            return 0.0
        regs = bytes(map(max, *live)) if len(live) > 1 else bytes(live[0])
        return _estimate(regs)


def _estimate(regs: bytes) -> float:
    m = len(regs)
    alpha = 0.7213 / (1 + 1.079 / m)
    raw = alpha * m * m / sum(2.0 ** -r for r in regs)
    zeros = regs.count(0)
    if raw <= 2.5 * m and zeros:
        return m * math.log(m / zeros)  # linear counting: exact enough where HLL is biased
    return raw
