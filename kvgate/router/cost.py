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
``externality_weight`` (0 gives the greedy newcomer-only choice; 1 minimises the fleet's mean TTFT,
which measured 232 → see docs/routing.md for the numbers).

The worker with the lowest cost wins; the conversation's home worker gets ``affinity_bonus_ms``
as a tie-breaker prior, and a worker above ``(1 + load_epsilon)·mean + 1`` in-flight requests is left
out (bounded load), so no estimate error can pile a fleet's traffic on one worker.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from kvgate.router.types import Decision, FleetView, RouteRequest, WorkerView


class CostParams(BaseModel):
    """Profile coefficients and weights; validated, and tunable at run time (PATCH /admin/policy)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

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
    affinity_cache_fraction: float = Field(1.0, ge=0, description="extra home prior: this fraction of the "
                                           "prefill time its cached prefix saves (moving a conversation also "
                                           "costs its next turns)")
    externality_weight: float = Field(1.0, ge=0, description="weight of the delay a request imposes on the "
                                      "requests already waiting for their first token on a worker")
    load_epsilon: float = Field(1.0, ge=0, description="bounded load: (1+eps)*mean+1 in-flight at most")



class CostModel:
    name = "cost_model"

    def __init__(self, params: CostParams | None = None) -> None:
        self.params = params or CostParams()

    def cached_tokens(self, request: RouteRequest, w: WorkerView) -> int:
        bs = request.block_size
        limit = max(0, (request.prompt_tokens - 1) // bs) * bs  # vLLM recomputes the last token
        return min(request.matched_blocks.get(w.id, 0) * bs, limit)

    def ttft_ms(self, request: RouteRequest, w: WorkerView) -> float:
        p = self.params
        cached = self.cached_tokens(request, w)
        mine = max(1, request.prompt_tokens - cached)
        total = w.pending_prefill_tokens + mine
        full, rest = divmod(total, p.token_budget)
        passes = [p.token_budget] * full + ([rest] if rest else [])
        prefill = sum(p.p0_ms + p.p1_ms * t + p.p2_ms * t * t for t in passes)
        attention = p.p_attn_ms * mine * cached / 1e6
        decode = len(passes) * self.decode_step_ms(w) if w.decode_requests else 0.0
        return prefill + attention + decode

    def home_bonus_ms(self, request: RouteRequest, w: WorkerView) -> float:
        p = self.params
        cached = self.cached_tokens(request, w)
        return p.affinity_bonus_ms + p.affinity_cache_fraction * (p.p1_ms * cached + p.p2_ms * cached * cached)

    def delay_to_others_ms(self, request: RouteRequest, w: WorkerView) -> float:
        """How much longer the requests already waiting on ``w`` take, summed over them."""
        if w.pending_requests <= 0:
            return 0.0
        p = self.params
        mine = max(1, request.prompt_tokens - self.cached_tokens(request, w))
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
        scores = {w.id: self.ttft_ms(request, w) + self.params.externality_weight * self.delay_to_others_ms(request, w)
                  for w in eligible}
        home = request.home_worker

        def key(w: WorkerView) -> tuple[float, str]:
            return (scores[w.id] - (self.home_bonus_ms(request, w) if w.id == home else 0.0), w.id)

        best = min(eligible, key=key)
        cached = self.cached_tokens(request, best)
        best_cached = max(self.cached_tokens(request, w) for w in eligible)
        fastest = min(eligible, key=lambda w: (scores[w.id], w.id))
        if best.id == home and fastest.id != home:
            reason = "affinity"
        elif best_cached == 0:
            reason = "cold_least_ttft"
        elif cached == best_cached:
            reason = "longest_prefix"
        else:
            reason = "load_over_prefix"
        if len(eligible) < len(workers) and reason != "affinity":
            reason += "_bounded"
        return Decision(worker=best.id, reason=reason, expected_cached_tokens=cached, scores=scores)
