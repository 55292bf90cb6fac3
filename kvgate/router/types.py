"""The routing contract's types: what a policy reads (a frozen snapshot) and what it returns."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NewType

WorkerId = NewType("WorkerId", str)
ConversationId = NewType("ConversationId", str)


@dataclass(frozen=True, slots=True)
class WorkerView:
    """One worker as the router sees it at decision time."""

    id: WorkerId
    model: str
    healthy: bool
    in_flight: int
    """Requests kvgate has sent to this worker and not yet finished."""
    running: int = 0
    """``vllm:num_requests_running`` at the last poll (0 before the first)."""
    waiting: int = 0
    """``vllm:num_requests_waiting`` at the last poll."""
    kv_usage: float = 0.0
    """``vllm:kv_cache_usage_perc``, 0..1."""
    pending_prefill_tokens: int = 0
    """Uncached prompt tokens of kvgate's requests on this worker that have not produced a first token."""
    pending_requests: int = 0
    """How many requests those pending prefill tokens belong to."""
    decode_requests: int = 0
    """kvgate's requests on this worker that are past their first token."""
    decode_tokens: int = 0
    """Their total context (prompt + generated so far, estimated)."""
    reserved_tokens: int = 0
    """KV of sessions parked here while a short tool runs: cached but unreferenced, so a newcomer that
    needs more room than is free evicts it (see ``session/waits.py``)."""
    kv_capacity_tokens: int = 0
    """The worker's GPU KV capacity in tokens (0 when unknown: reservations are then not priced)."""
    node: str = ""
    """Workers on one node share its CPU tier (LMCache L1); "" means a node of its own."""
    max_running: int = 0
    """Requests its engine runs at once (configured or learned from its counters; 0 when unknown): a
    request beyond them waits in the engine's queue for one to finish."""
    foreign_requests: int = 0
    """Requests on it that are not this replica's (other gateway replicas', other clients'), at the last
    poll: they hold its running slots too."""
    service_ms: float = 0.0
    """How long a request holds it, on average (0 when unknown)."""
    load_backlog_ms: float = 0.0
    """Transfer time of the tier loads still ahead on its engine's channel, as the router estimates them
    from the loads it sent there (0 when unknown); priced only when the engines load asynchronously."""

    @property
    def load(self) -> int:
        """The load bounded-load rules compare: kvgate's own in-flight count. It is exact and current,
        where the engine's polled counters lag by up to a poll interval and would make a worker look
        busy with the very request that just finished."""
        return self.in_flight


@dataclass(frozen=True, slots=True)
class FleetView:
    """An immutable snapshot of the workers that serve one model."""

    workers: tuple[WorkerView, ...]

    def healthy(self) -> tuple[WorkerView, ...]:
        return tuple(w for w in self.workers if w.healthy)

    def get(self, wid: WorkerId) -> WorkerView | None:
        for w in self.workers:
            if w.id == wid:
                return w
        return None


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What a policy may know of a request."""

    model: str
    conversation_id: ConversationId
    home_worker: WorkerId | None = None
    """Where this conversation was last served, from the session store."""
    prompt_tokens: int = 0
    """Prompt length in tokens (0 when unknown)."""
    exclude: frozenset[WorkerId] = frozenset()
    """Workers already tried for this request (retries)."""
    matched_blocks: Mapping[WorkerId, int] = field(default_factory=dict)
    """Longest cached prefix of the prompt on each worker, in blocks (the index's answer, computed once
    per request so that every scorer reads the same result)."""
    block_size: int = 16
    cpu_tokens: Mapping[str, int] = field(default_factory=dict)
    """Longest prefix of the prompt in a CPU tier, in tokens: a node's (LMCache L1) keyed by node, a worker's
    own (SGLang HiCache host pool, vLLM CPU offload, as their KV events say) keyed by worker id."""
    remote_tokens: int = 0
    """Longest prefix of the prompt in the shared remote tier (LMCache L2 in Redis), in tokens."""


@dataclass(frozen=True, slots=True)
class Decision:
    worker: WorkerId
    reason: str
    """Why this worker, a short stable label (``longest_prefix``, ``affinity``, ``sticky``, ...), counted in
    ``kvgate_route_decisions_total{policy,reason,tier,bounded}``."""
    expected_cached_tokens: int = 0
    scores: Mapping[WorkerId, float] = field(default_factory=dict)
    """Per-worker score the policy compared (lower is better), for explanation and debugging."""
    expected_loaded_tokens: int = 0
    """Tokens the chosen worker is expected to load from a CPU or remote tier instead of computing."""
    expected_remote_tokens: int = 0
    """Of those, the tokens from the remote tier (the rest come from the node's CPU tier)."""
    tier: str = "none"
    """Where the longest part of the reused prefix comes from: gpu, cpu, remote, or none."""
    bounded: bool = False
    """Bounded load left some workers out (the best-scoring one may have been among them)."""
