"""The cost-model policy: send a request where its time to first token will be lowest.

For each eligible worker::

    cached   = min(matched blocks · block size, whole blocks below the prompt's last token)
    mine     = prompt − cached                      (tokens this request must prefill)
    ahead    = pending prefill tokens of requests already sent there (FCFS: they go first)
    steps    = ceil((ahead + mine) / token budget)  (chunked prefill passes until our first token)
    TTFT     = prefill(ahead + mine, in budget-sized passes) + attention(mine over cached context)
               + steps · decode step of the batch already decoding there

A request also delays the requests already waiting there for their first token: the engine packs
their chunks and ours into the same pass, and the pass takes longer for everyone in it. That delay,
``waiting · (prefill(ahead + ours in that pass) − prefill(ahead))``, is added with
``externality_weight`` (0 gives the greedy newcomer-only choice; 1 counts every second of delay the
same, whoever waits).

Every token a request prefills is also work the fleet does instead of someone else's: whoever is
queued when it runs waits for it. With the fleet's queues empty that costs nobody; under load it
costs about as many waiters as are queued per worker, so the prefill this request adds is charged
``backlog_weight × (requests waiting for a first token per worker)`` times. Recomputing a prefix that
another worker holds is then dear exactly when the fleet is short of capacity — when giving up reuse
turns a long queue into a longer one for everybody.

Tiers (LMCache): beyond the GPU hit, the prompt's prefix may sit in the worker's node CPU tier (L1)
or in the shared remote tier (L2, Redis). The engine loads those tokens instead of computing them, at
``bytes_per_token / bandwidth`` (plus one round trip for the remote tier), so a worker with a CPU-tier
copy can beat a cold one by the whole prefill, and any worker can reuse what Redis holds.

How the engine waits for a load decides who pays for it (``tier_loads``, ``sim/engine.py``):

- ``sync`` (LMCache's default, ``enable_async_loading: false``): the step that admits the request
  waits for its KV, so every request decoding or waiting there waits with it. That stall,
  ``load · (decoding + waiting requests)``, is added with ``externality_weight``, like the delay a
  prefill chunk imposes.
- ``async`` (LMCache's ``async_loading``; vLLM's ``load_kv_async``): the request waits alone with its
  blocks allocated while the batch keeps stepping, but the loads of one worker queue on its transfer
  channel (PCIe / NIC), so a newcomer that loads also waits for the loads ahead of it there
  (``WorkerView.load_backlog_ms``). Nobody already there waits for it.

A worker whose engine already runs as many requests as it can at once (``max_running``: configured or
learned from its counters) queues a newcomer until one finishes: with ``n`` requests there (this
replica's and the others'), the ``n - max_running + 1``-th completion of ``max_running`` running ones
comes after about ``(n - max_running + 1) / (max_running + 1)`` of a request's holding time, and that
wait is added (``slot_wait_weight``). A conversation whose prefix is cached on a full home worker still
goes there when recomputing it elsewhere costs more than the wait.

A worker that hosts sessions parked on short tool waits (``reserved_tokens``) loses their KV when a
newcomer needs more room than is free; the router charges the newcomer what those sessions would pay
to get it back (``reservation_weight`` per token at recompute speed), so new work goes elsewhere first.

The worker with the lowest cost wins; taking a conversation away from its home worker is charged the
prefill time of the home's cached prefix that the new worker lacks (``affinity_cache_fraction`` times:
its next turns need it again), the home gets ``affinity_bonus_ms`` as a tie-breaker, and a worker
above ``(1 + load_epsilon)·mean + 1`` in-flight requests is left out (bounded load), so no estimate
error can pile a fleet's traffic on one worker.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvgate.router.types import Decision, FleetView, RouteRequest, WorkerView


class CostParams(BaseModel):
    """Profile coefficients and weights; validated, and tunable at run time (PATCH /admin/policy)."""

    # No inf or NaN, from a config file or a PATCH (where a string "Infinity" would otherwise become one).
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    p0_ms: float = Field(16.5, ge=0, description="fixed cost of a prefill pass")
    p1_ms: float = Field(0.0152, ge=0, description="per prefilled token")
    p2_ms: float = Field(4.21e-7, ge=0, description="per token squared, within one pass")
    p_attn_ms: float = Field(0.0, ge=0, description="per (token x cached context token) / 1e6")
    decode_ms: float = Field(6.0, ge=0, description="one decode step of a lightly loaded batch")
    decode_ms_per_request: float = Field(0.02, ge=0)
    decode_u1_ms: float = Field(0.0, description="decode step growth with KV occupancy u (linear term)")
    decode_u2_ms: float = Field(0.0, description="decode step growth with KV occupancy u (square term)")
    kv_capacity_tokens: int = Field(1_048_576, gt=0, description="KV capacity of one worker, for u")
    token_budget: int = Field(8192, gt=0, description="max tokens in one engine step")
    affinity_bonus_ms: float = Field(2.0, ge=0, description="prior for the conversation's home worker")
    affinity_cache_fraction: float = Field(4.0, ge=0, description="charge for leaving the home: this fraction of "
                                           "the prefill time of the home's cached prefix the new worker lacks "
                                           "(moving a conversation also costs its next turns)")
    externality_weight: float = Field(1.0, ge=0, description="weight of the delay a request imposes on the "
                                      "requests already waiting for their first token on a worker")
    backlog_weight: float = Field(1.0, ge=0, description="charge for the prefill a request adds, per request "
                                  "waiting for a first token per worker across the fleet")
    load_epsilon: float = Field(1.0, ge=0, description="bounded load: (1+eps)*mean+1 in-flight at most")
    kv_bytes_per_token: int = Field(131_072, gt=0, description="KV bytes per token (Llama-3-8B bf16: "
                                    "2 x 32 layers x 8 KV heads x 128 dims x 2 bytes)")
    cpu_load_gbps: float = Field(20.0, gt=0, description="host-to-device copy, GB/s (PCIe Gen4 x16 in practice)")
    remote_load_gbps: float = Field(2.5, gt=0, description="remote tier to device, GB/s (25 GbE plus the copy)")
    remote_rtt_ms: float = Field(1.0, ge=0, description="one round trip to the remote tier")
    reservation_weight: float = Field(1.0, ge=0, description="price of evicting a parked session's KV, as a "
                                      "fraction of recomputing it")
    slot_wait_weight: float = Field(1.0, ge=0, description="weight of the wait for a running slot on a worker "
                                    "whose engine runs all it can at once")
    tier_loads: Literal["sync", "async"] = Field("sync", description="how the engines wait for a tier load: "
                                                 "sync stalls the step that admits it (LMCache's default), async "
                                                 "waits alone, queued on the worker's transfer channel "
                                                 "(LMCache enable_async_loading)")

    @model_validator(mode="after")
    def _decode_not_negative(self) -> CostParams:
        # The occupancy terms may be negative (a fitted curve: Dynamo's mocker has u2 = -25.74), but the decode
        # step they describe may not be, at any KV occupancy u in [0, 1]: the minimum is at an end or, for a
        # convex curve, at its vertex.
        d0, d1, d2 = self.decode_ms, self.decode_u1_ms, self.decode_u2_ms
        lowest = min(d0, d0 + d1 + d2)
        if d2 > 0 and 0 < -d1 / (2 * d2) < 1:
            lowest = min(lowest, d0 - d1 * d1 / (4 * d2))
        if lowest < 0:
            raise ValueError(f"decode_ms + decode_u1_ms*u + decode_u2_ms*u^2 is negative ({lowest:.4g} ms) at some "
                             "KV occupancy u in [0, 1]")
        return self



def with_measured_rates(params: CostParams, cpu_load_gbps: float | None, remote_load_gbps: float | None
                        ) -> CostParams:
    """``params`` with the tier load rates measured on the fleet (``kvstore/tiers.TransferRates``) in place
    of the configured ones; a rate not measured yet keeps its value."""
    update = {k: v for k, v in (("cpu_load_gbps", cpu_load_gbps), ("remote_load_gbps", remote_load_gbps))
              if v is not None and v > 0}
    return params.model_copy(update=update) if update else params


class CostModel:
    name = "cost_model"

    def __init__(self, params: CostParams | None = None) -> None:
        self.params = params or CostParams()

    @staticmethod
    def _limit(request: RouteRequest) -> int:
        bs = request.block_size
        return max(0, (request.prompt_tokens - 1) // bs) * bs  # vLLM recomputes the last token

    def cached_tokens(self, request: RouteRequest, w: WorkerView) -> int:
        """The prefix already in this worker's GPU KV."""
        return min(request.matched_blocks.get(w.id, 0) * request.block_size, self._limit(request))

    def reuse(self, request: RouteRequest, w: WorkerView) -> Reuse:
        limit = self._limit(request)
        gpu = self.cached_tokens(request, w)
        # A node's shared CPU tier (LMCache L1) or the worker's own (HiCache host pool, from its events).
        own = max(request.cpu_tokens.get(w.node, 0) if w.node else 0, request.cpu_tokens.get(w.id, 0))
        cpu = max(gpu, min(limit, own))
        remote = max(cpu, min(limit, request.remote_tokens))
        return Reuse(gpu, cpu - gpu, remote - cpu)

    def load_ms(self, r: Reuse) -> float:
        p = self.params
        ms = r.cpu * p.kv_bytes_per_token / (p.cpu_load_gbps * 1e6)
        if r.remote:
            ms += p.remote_rtt_ms + r.remote * p.kv_bytes_per_token / (p.remote_load_gbps * 1e6)
        return ms

    def _pass_ms(self, tokens: int) -> float:
        p = self.params
        return p.p0_ms + p.p1_ms * tokens + p.p2_ms * tokens * tokens if tokens > 0 else 0.0

    def ttft_ms(self, request: RouteRequest, w: WorkerView) -> float:
        p = self.params
        r = self.reuse(request, w)
        mine = max(1, request.prompt_tokens - r.total)
        full, rest = divmod(w.pending_prefill_tokens + mine, p.token_budget)
        passes = [p.token_budget] * full + ([rest] if rest else [])
        prefill = sum(self._pass_ms(t) for t in passes)
        attention = p.p_attn_ms * mine * r.total / 1e6
        decode = len(passes) * self.decode_step_ms(w) if w.decode_requests else 0.0
        return prefill + attention + decode + self.load_ms(r) + self.channel_wait_ms(r, w)

    def channel_wait_ms(self, r: Reuse, w: WorkerView) -> float:
        """An asynchronous load waits for the loads ahead of it on the worker's transfer channel."""
        if self.params.tier_loads != "async" or not (r.cpu or r.remote):
            return 0.0
        return max(0.0, w.load_backlog_ms)

    def load_stall_ms(self, request: RouteRequest, w: WorkerView) -> float:
        """A synchronous load is waited for by the step that admits the request, so every request decoding
        or waiting on ``w`` waits with it: the load's time, once for each of them."""
        if self.params.tier_loads != "sync":
            return 0.0
        n = w.decode_requests + w.pending_requests
        return n * self.load_ms(self.reuse(request, w)) if n > 0 else 0.0

    def backlog_ms(self, request: RouteRequest, w: WorkerView, waiting_per_worker: float) -> float:
        """What the prefill this request adds on ``w`` costs the requests queued across the fleet."""
        if waiting_per_worker <= 0:
            return 0.0
        p = self.params
        mine = max(1, request.prompt_tokens - self.reuse(request, w).total)
        return p.backlog_weight * waiting_per_worker * (p.p1_ms * mine + p.p2_ms * mine * mine)

    def slot_wait_ms(self, w: WorkerView) -> float:
        """How long a newcomer waits in the engine's queue for a running slot to free."""
        if w.max_running <= 0 or w.service_ms <= 0:
            return 0.0
        ahead = w.in_flight + w.foreign_requests - w.max_running + 1
        if ahead <= 0:
            return 0.0
        return self.params.slot_wait_weight * ahead * w.service_ms / (w.max_running + 1)

    def reservation_ms(self, request: RouteRequest, w: WorkerView) -> float:
        """What the sessions parked on ``w`` would pay to recompute the KV this request evicts."""
        if w.reserved_tokens <= 0 or w.kv_capacity_tokens <= 0:
            return 0.0
        need = request.prompt_tokens - self.cached_tokens(request, w)
        used = int(w.kv_usage * w.kv_capacity_tokens)
        room = w.kv_capacity_tokens - used - w.reserved_tokens
        evicted = min(w.reserved_tokens, max(0, need - room))
        return self.params.reservation_weight * self.params.p1_ms * evicted

    def move_ms(self, request: RouteRequest, w: WorkerView) -> float:
        """The prior against taking the conversation away from its home worker to ``w``: the prefill time
        of the home's cached prefix that ``w`` lacks, times ``affinity_cache_fraction`` (the next turns
        would need it again, and the fleet would hold it twice). Nothing when ``w`` holds at least as
        much; ``affinity_bonus_ms`` breaks ties for the home."""
        p = self.params
        home = request.home_worker
        if home is None or w.id == home:
            return -p.affinity_bonus_ms if home is not None else 0.0
        limit = self._limit(request)
        lost = min(request.matched_blocks.get(home, 0) * request.block_size, limit) - self.cached_tokens(request, w)
        if lost <= 0:
            return 0.0
        return p.affinity_cache_fraction * (p.p1_ms * lost + p.p2_ms * lost * lost)

    def delay_to_others_ms(self, request: RouteRequest, w: WorkerView) -> float:
        """How much longer the requests already waiting on ``w`` take, summed over them."""
        if w.pending_requests <= 0:
            return 0.0
        p = self.params
        mine = max(1, request.prompt_tokens - self.reuse(request, w).total)
        ahead_in_pass = w.pending_prefill_tokens % p.token_budget
        shared = min(mine, max(0, p.token_budget - ahead_in_pass))
        if shared == 0:
            return 0.0

        def pre(t: int) -> float:
            return p.p1_ms * t + p.p2_ms * t * t

        return w.pending_requests * (pre(ahead_in_pass + shared) - pre(ahead_in_pass))

    def decode_step_ms(self, w: WorkerView) -> float:
        """The decode part of every pass while this worker's batch keeps decoding."""
        p = self.params
        u = min(1.0, w.decode_tokens / p.kv_capacity_tokens)
        return max(0.0, p.decode_ms + p.decode_u1_ms * u + p.decode_u2_ms * u * u
                   + p.decode_ms_per_request * w.decode_requests)

    def pick(self, request: RouteRequest, fleet: FleetView) -> Decision | None:
        workers = [w for w in fleet.healthy() if w.id not in request.exclude]
        if not workers:
            return None
        mean = sum(w.in_flight for w in workers) / len(workers)
        cap = (1 + self.params.load_epsilon) * mean + 1
        eligible = [w for w in workers if w.in_flight < cap] or workers
        waiting = sum(w.pending_requests for w in workers) / len(workers)
        scores = {w.id: self.ttft_ms(request, w) + self.params.externality_weight
                  * (self.delay_to_others_ms(request, w) + self.load_stall_ms(request, w))
                  + self.reservation_ms(request, w) + self.backlog_ms(request, w, waiting) + self.slot_wait_ms(w)
                  for w in eligible}
        home = request.home_worker

        def key(w: WorkerView) -> tuple[float, str]:
            return (scores[w.id] + self.move_ms(request, w), w.id)

        best = min(eligible, key=key)
        r = self.reuse(request, best)
        best_reuse = max(self.reuse(request, w).total for w in eligible)
        fastest = min(eligible, key=lambda w: (scores[w.id], w.id))
        if best.id == home and fastest.id != home:
            reason = "affinity"
        elif best_reuse == 0:
            reason = "cold_least_ttft"
        elif r.total == best_reuse:
            reason = "longest_prefix"
        else:
            reason = "load_over_prefix"
        return Decision(worker=best.id, reason=reason, expected_cached_tokens=r.total, scores=scores,
                        expected_loaded_tokens=r.cpu + r.remote, expected_remote_tokens=r.remote, tier=r.tier,
                        bounded=len(eligible) < len(workers))


@dataclass(frozen=True, slots=True)
class Reuse:
    """A request's reusable prefix on one worker, split by where it comes from (tokens)."""

    gpu: int
    cpu: int
    """Beyond the GPU hit, in the node's CPU tier."""
    remote: int
    """Beyond both, in the remote tier."""

    @property
    def total(self) -> int:
        return self.gpu + self.cpu + self.remote

    @property
    def tier(self) -> str:
        if self.total == 0:
            return "none"
        return max((self.gpu, "gpu"), (self.cpu, "cpu"), (self.remote, "remote"), key=lambda x: x[0])[1]
