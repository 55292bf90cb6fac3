"""Background prefill of the canonical branch: the decision (pure) and its bookkeeping.

When a turn ends, the next request will start with the canonical prefix P|A (this turn's reasoning
dropped or truncated per the policy), which differs from what the worker cached (P|R|A) after the
first dropped token. Prefilling P|A while the user reads moves that compute off the next turn's
critical path. The rule, per completed turn:

1. ``gain`` = tokens of P|A beyond its common prefix with the cached chain, in whole blocks. Nothing
   dropped, or a gain under ``min_gain_tokens``: skip (the next turn recomputes it cheaply).
2. The observed probability of another user turn must reach ``min_continue`` (default 0.8): a prefill
   is wasted when the user does not come back, so issuing only where that probability is at least
   ``1 - w`` keeps the wasted fraction under ``w``, as far as the estimate is calibrated. It is
   learned per tenant and per conversation size (``ContinueStats``): one conversation says little
   about itself (turns per session are close to geometric), while agent
   products differ a lot — an interactive assistant's users keep talking, a one-shot task agent's
   session ends after its answer — and a conversation near its context budget ends or compacts (both
   break the prefix) whatever its tenant. The tenant's rate is a Beta posterior (prior 1:1: no prefill
   until a tenant has shown that its users come back); a size bucket's rate is shrunk towards it.
3. The home worker must have no foreground request waiting for its first token and KV usage under
   ``max_kv_usage``: a background prefill never queues ahead of a user and never evicts to make room.
4. The tenant's background-prefill budget (``prefill_tokens_per_minute``, docs/admission.md), when it
   has one, must still hold the gain: ``over_budget`` otherwise. The gain is what the budget counts —
   the tokens the prefill makes the engine compute; the part of the prefix the worker caches costs it
   a lookup, and counting it would let one long conversation spend a minute's budget on a few hundred
   tokens of work. Checked last, so ``over_budget`` counts only prefills the budget alone prevented.

The reasoning/answer ratio enters through (1): the longer the dropped reasoning relative to the
answer, the more of the cached chain is dead, but the gain is the answer and what follows it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass
from typing import TypeVar

from pydantic import BaseModel, ConfigDict, Field

K = TypeVar("K", bound=Hashable)


class PrefillParams(BaseModel):
    # No inf or NaN, from a config file or a PATCH (where a string "Infinity" would otherwise become one).
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    enabled: bool = True
    min_gain_tokens: int = Field(128, ge=0, description="skip when the canonical branch adds fewer tokens")
    min_continue: float = Field(0.8, ge=0, le=1, description="skip below this probability of another turn: "
                                "1 - the fraction of prefills an operator accepts to waste")
    prior_continue: int = Field(1, ge=0, description="Beta prior: pseudo-turns that continued")
    prior_stop: int = Field(1, ge=0, description="Beta prior: pseudo-turns that ended the conversation")
    settle_s: float = Field(1800.0, gt=0, description="an answer without a next user turn for this long counts "
                            "as the conversation's end (and its prefill as wasted)")
    bucket_weight: float = Field(2.0, ge=0, description="pseudo-turns of the tenant's rate in a size bucket's")
    max_kv_usage: float = Field(0.8, ge=0, le=1, description="skip when the worker's KV is fuller than this: "
                                "there the prefill competes with users for memory (docs/tiering.md: 0.7, 0.8 "
                                "and 0.9 measured on three workload seeds)")


@dataclass(frozen=True, slots=True)
class PrefillDecision:
    issue: bool
    reason: str
    """issued, disabled, nothing_dropped, small_gain, unlikely_to_continue, worker_busy, kv_pressure,
    over_budget."""
    gain_tokens: int = 0
    p_continue: float = 0.0


def gain_tokens(common: int, prefix_len: int, block_size: int) -> int:
    """Tokens of the next-turn prefix (whole blocks) that the cached chain does not already hold, given
    the two's common prefix (``gateway.prompts.common_prefix``): the divergence point."""
    full = prefix_len // block_size * block_size
    return max(0, full - common // block_size * block_size)


def p_continue(params: PrefillParams, continued: int, ended: int) -> float:
    return (continued + params.prior_continue) / (continued + ended + params.prior_continue + params.prior_stop or 1)


class ContinueStats:
    """How often a conversation gets another user turn after an answer, per tenant and per size bucket
    (prefix tokens, powers of two from 1k)."""

    def __init__(self, params: PrefillParams, max_keys: int = 10_000) -> None:
        self.params = params
        self._max = max_keys
        self._tenant: OrderedDict[str, list[int]] = OrderedDict()
        self._bucket: OrderedDict[tuple[str, int], list[int]] = OrderedDict()

    @staticmethod
    def bucket(tokens: int) -> int:
        return max(0, tokens.bit_length() - 10)

    def _add(self, tenant: str, tokens: int, i: int) -> None:
        self._count(self._tenant, tenant, i)
        self._count(self._bucket, (tenant, self.bucket(tokens)), i)

    def _count(self, d: OrderedDict[K, list[int]], key: K, i: int) -> None:
        d.setdefault(key, [0, 0])[i] += 1
        d.move_to_end(key)
        while len(d) > self._max:
            d.popitem(last=False)

    def continued(self, tenant: str, tokens: int) -> None:
        self._add(tenant, tokens, 0)

    def ended(self, tenant: str, tokens: int) -> None:
        self._add(tenant, tokens, 1)

    def p(self, tenant: str, tokens: int) -> float:
        c, e = self._tenant.get(tenant, [0, 0])
        pt = p_continue(self.params, c, e)
        bc, be = self._bucket.get((tenant, self.bucket(tokens)), [0, 0])
        k = self.params.bucket_weight
        return (bc + k * pt) / (bc + be + k) if bc + be + k > 0 else pt

    def snapshot(self) -> dict[str, list[int]]:
        return {t: list(v) for t, v in self._tenant.items()}


def decide(params: PrefillParams, gain: int, p: float, *, pending_requests: int, kv_usage: float,
           budget: float | None = None) -> PrefillDecision:
    """``budget``: the tenant's background-prefill tokens left (None: no budget)."""
    if not params.enabled:
        return PrefillDecision(False, "disabled")
    if gain <= 0:
        return PrefillDecision(False, "nothing_dropped", 0, p)
    if gain < params.min_gain_tokens:
        return PrefillDecision(False, "small_gain", gain, p)
    if p < params.min_continue:
        return PrefillDecision(False, "unlikely_to_continue", gain, p)
    if pending_requests > 0:
        return PrefillDecision(False, "worker_busy", gain, p)
    if kv_usage > params.max_kv_usage:
        return PrefillDecision(False, "kv_pressure", gain, p)
    if budget is not None and gain > budget:
        return PrefillDecision(False, "over_budget", gain, p)
    return PrefillDecision(True, "issued", gain, p)


@dataclass(slots=True)
class PrefillStats:
    """Counters the gateway exports and the benchmark prints."""

    decided: dict[str, int]
    issued: int = 0
    completed: int = 0
    failed: int = 0
    used: int = 0
    wasted: int = 0
    skipped: int = 0
    """Cancelled before they started: the next request arrived first."""
    saved_ms: float = 0.0
    """Prefill time the used ones took off next turns' critical path (cost-model estimate)."""

    @classmethod
    def new(cls) -> PrefillStats:
        return cls({})

    def count(self, d: PrefillDecision) -> None:
        self.decided[d.reason] = self.decided.get(d.reason, 0) + 1
        self.issued += d.issue

    @property
    def waste_fraction(self) -> float:
        settled = self.used + self.wasted
        return self.wasted / settled if settled else 0.0
