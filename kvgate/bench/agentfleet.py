"""The agent benchmark's fleet: generated agent sessions (``bench/agents.py``) on the session fleet of
``sim/sessions.py`` (simulated engines with LMCache tiers in virtual time, kvgate's router and session
controller). What each mode changes:

- ``no_tiering``: engines with GPU KV only; kvgate's cost model over the KV-event index; the
  controller tracks the lifecycle but plans no tool waits.
- ``lmcache``: engines store every computed chunk to their node's CPU tier and the shared remote tier
  and load from them on a miss; kvgate routes as above, blind to the tiers (LMCache without kvgate's
  lifecycle).
- ``kvgate``: the router also sees tier residency and prices loads; the controller predicts tool waits
  online, reserves the KV of short ones on the home worker and releases long ones with a prefetch
  before the predicted resume.
- ``rr_pool``: round robin over engines that share one pool (the remote tier) and have no L1 — the
  vLLM + Mooncake store setup; ``dynamo_credits``: Dynamo's tier credits over kvgate's index and tier
  estimate, no lifecycle (reference rows; the benchmark gives them a shared pool's rates).
- ``+prefill`` (a flag on any mode): the controller's background prefill of the canonical branch when
  a turn ends, at the engine's lowest priority.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvgate.bench.agents import SessionScript, canonical_history, next_turn_prefix
from kvgate.sim.sessions import SessionFleet
from kvgate.sim.sessiontypes import MODES, Prefix, Request, TierConfig, TurnResult
from kvgate.sim.timing import TimingProfile

__all__ = ["AGENT_MODES", "AgentFleet", "ScriptSource", "TierConfig", "TurnResult"]

AGENT_MODES = ("no_tiering", "lmcache", "kvgate", "rr_pool", "dynamo_credits")


@dataclass(frozen=True, slots=True)
class ScriptSource:
    """A generated session as a source of requests: its canonical history as tokens."""

    script: SessionScript

    @property
    def id(self) -> str:
        return self.script.id

    @property
    def tenant(self) -> str:
        return self.script.agent_type

    @property
    def start_s(self) -> float:
        return self.script.start_s

    @property
    def heavy(self) -> bool:
        return self.script.heavy

    def rounds(self) -> int:
        return len(self.script.rounds)

    def wait_s(self, i: int) -> float:
        return self.script.rounds[i].wait_s

    def kind(self, i: int) -> str:
        return self.script.rounds[i].kind

    def tools(self, i: int) -> tuple[str, ...]:
        return self.script.rounds[i].tools

    def request(self, i: int, chain: list[int]) -> Request:
        r = self.script.rounds[i]
        return Request(canonical_history(self.script, i), r.reasoning + r.visible)

    def next_prefix(self, i: int) -> Prefix:
        return Prefix(next_turn_prefix(self.script, i))


class AgentFleet(SessionFleet):
    def __init__(self, profile: TimingProfile, n_workers: int, workers_per_node: int, mode: str, **kw: Any) -> None:
        if mode not in AGENT_MODES:
            raise ValueError(f"unknown mode {mode!r}; expected one of {', '.join(AGENT_MODES)}")
        self.mode = mode
        super().__init__(profile, n_workers, workers_per_node, MODES[mode], **kw)

    def run(self, sources: Sequence[Any]) -> list[TurnResult]:
        return super().run([ScriptSource(s) if isinstance(s, SessionScript) else s for s in sources])
