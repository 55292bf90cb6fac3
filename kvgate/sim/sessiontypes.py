"""The session fleet's vocabulary (``sim/sessions.py``): where a session's requests come from, what the
fleet has, and what each request did."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from kvgate.router.hashing import BlockHash


class Request(NamedTuple):
    """One request of a session, as its source gives it."""

    tokens: list[int]
    """The prompt (placeholders of the right length when ``hashes`` are given)."""
    output: list[int]
    """What the engine generates (its length is what counts)."""
    hashes: list[BlockHash] | None = None
    """The prompt's full blocks; None: the fleet hashes ``tokens``."""
    common: int = 0
    """With ``hashes``: prompt tokens the session's previous request had computed (the rest is new)."""
    output_hashes: Sequence[BlockHash] = ()
    """With ``hashes``: the blocks the output completes, from the prompt's last (partial) block on, as far
    as they are known (the next prompt reuses them); the engine hashes the rest itself."""


class Prefix(NamedTuple):
    """The next turn's canonical prefix (what a background prefill computes)."""

    tokens: list[int]
    hashes: list[BlockHash] | None = None


class SessionSource(Protocol):
    """Where a session's requests come from: a generated agent script or a request log."""

    @property
    def id(self) -> str: ...

    @property
    def tenant(self) -> str: ...

    @property
    def start_s(self) -> float: ...

    @property
    def heavy(self) -> bool: ...

    def rounds(self) -> int: ...

    def wait_s(self, i: int) -> float:
        """Between the end of request ``i - 1`` and request ``i``."""
        ...

    def kind(self, i: int) -> str:
        """``user`` (a new user turn) or ``tool`` (resumes after tool results)."""
        ...

    def tools(self, i: int) -> tuple[str, ...]:
        """The tools request ``i``'s response calls (none: an answer)."""
        ...

    def request(self, i: int, chain: list[int]) -> Request: ...

    def next_prefix(self, i: int) -> Prefix:
        """The canonical prefix of the request after ``i`` (which ended with an answer)."""
        ...


@dataclass(frozen=True, slots=True)
class Setup:
    """What the fleet has (see the module's docstring)."""

    tiers: bool = False
    tier_routing: bool = False
    plan_waits: bool = False
    policy: str = "cost_model"
    """The router's policy (``router.policies``); the reference rows use round robin or Dynamo's credits."""
    l1: bool = True
    """Engines have their node's CPU tier; without it, only the shared remote tier (a shared pool)."""


MODES = {"no_tiering": Setup(), "lmcache": Setup(tiers=True), "kvgate": Setup(True, True, True),
         "gateway": Setup(plan_waits=True),
         "rr_pool": Setup(tiers=True, policy="round_robin", l1=False),
         "dynamo_credits": Setup(tiers=True, tier_routing=True, policy="dynamo_credits")}
"""The agent benchmark's modes, and ``gateway``: a kvgate without LMCache tiers (it still plans waits and
reserves the KV of short ones). ``rr_pool``: round robin over engines that share one pool and have no L1
(vLLM + Mooncake store); ``dynamo_credits``: Dynamo's tier credits over kvgate's index and tier estimate,
without kvgate's lifecycle."""


@dataclass(frozen=True, slots=True)
class TierConfig:
    chunk_tokens: int = 256
    cpu_tokens_per_node: int = 1_500_000
    """LMCache L1 per node (1.5M tokens x 128 KiB = 196 GB of host memory)."""
    remote_tokens: int | None = None
    """LMCache L2 (Redis); None: large enough to keep everything of the run."""
    kv_bytes_per_token: int = 131_072
    cpu_gbps: float = 20.0
    remote_gbps: float = 2.5
    remote_rtt_ms: float = 1.0
    async_loads: bool = False
    """The engines load from the tiers asynchronously (``sim.tiers.EngineTiers.async_loads``)."""


@dataclass(slots=True)
class TurnResult:
    session: str
    round: int
    kind: str
    """``first`` (a session's first request), ``tool`` (resumed after a tool wait), ``user`` (a new user turn)."""
    heavy: bool
    worker: int
    arrival: float
    prompt: int
    novel: int
    """Prompt tokens the session never had computed before (beyond the previous chain)."""
    expected: int
    reuse: int = -1
    """Tokens not computed: GPU hit plus tier load (vLLM's cached_tokens)."""
    external: int = 0
    first_token: float | None = None
    finish: float | None = None
    gpu_resident: int = 0
    """Prefix tokens on the home worker's GPU when the request arrived (what its KV kept while waiting)."""

    @property
    def ttft_ms(self) -> float:
        assert self.first_token is not None
        return (self.first_token - self.arrival) * 1000

    @property
    def recomputed(self) -> int:
        return max(0, self.prompt - max(0, self.reuse) - self.novel)
