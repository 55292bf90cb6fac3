"""How long a session will wait on its tools, and what to do with its KV meanwhile.

Pure: durations come in as numbers, time as an argument. The gateway feeds it from real requests,
the fleet benchmark from virtual time, with the same code.

Prediction: a quantile (default p90) of the most recent durations of (tenant, tool); until a key has
``min_samples`` observations it borrows the tool's durations across tenants, then the configured
prior. A response that calls several tools waits for the slowest, so the prediction is their maximum.

Plan (the rule, per wait):
- predicted ≤ ``reserve_max_s``: *reserve* — the KV stays counted on its home worker until
  ``predicted · deadline_factor`` has passed (then the reservation lapses and the wait is counted as
  overrun). Waits this short are most of them (86% of an agent's requests return within 1 s), and
  reloading even from CPU costs more than keeping the blocks for that long.
- longer: *release* — the blocks may be evicted (LMCache already holds them, store-on-compute), and
  a prefetch is due ``prefetch_lead_s`` before the predicted resume, so the next request finds the
  prefix in the CPU tier rather than in Redis.
- a short wait whose tenant's parked-KV budget cannot hold its KV is planned as a long one
  (``released``; the session controller decides that, the budget is its input).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field


class WaitParams(BaseModel):
    # No inf or NaN, from a config file or a PATCH (where a string "Infinity" would otherwise become one).
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    quantile: float = Field(0.9, gt=0, le=1, description="quantile of recent durations used as the prediction")
    window: int = Field(64, ge=1, le=10_000, description="recent durations kept per (tenant, tool)")
    min_samples: int = Field(3, ge=1, description="observations before a key's own quantile is trusted")
    prior_s: float = Field(5.0, ge=0, description="prediction for a tool never seen")
    tool_priors_s: dict[str, Annotated[float, Field(ge=0)]] = Field(default_factory=dict,
                                                                    description="per tool name priors")
    reserve_max_s: float = Field(5.0, ge=0, description="waits predicted up to this keep their KV reserved")
    deadline_factor: float = Field(2.0, ge=1, description="a reservation lapses after prediction x this")
    prefetch_lead_s: float = Field(2.0, ge=0, description="prefetch this long before the predicted resume")
    max_keys: int = Field(10_000, ge=1, le=1_000_000, description="(tenant, tool) keys remembered (LRU); tool "
                          "names come from clients, so this bounds their memory")


@dataclass(frozen=True, slots=True)
class WaitPlan:
    predicted_s: float
    action: str
    """``reserve`` or ``release``."""
    deadline: float
    """Reserve: when the reservation lapses. Release: the predicted resume time."""
    prefetch_at: float | None = None


class WaitPredictor:
    def __init__(self, params: WaitParams | None = None) -> None:
        self.params = params or WaitParams()
        self._recent: OrderedDict[tuple[str, str], deque[float]] = OrderedDict()
        self.observed = 0
        self.overruns = 0

    def _samples(self, key: tuple[str, str]) -> deque[float] | None:
        d = self._recent.get(key)
        if d is not None and len(d) >= self.params.min_samples:
            return d
        return None

    def _quantile(self, xs: Sequence[float]) -> float:
        s = sorted(xs)
        i = min(len(s) - 1, max(0, round(self.params.quantile * (len(s) - 1))))
        return s[i]

    def predict_tool(self, tenant: str, tool: str) -> float:
        for key in ((tenant, tool), ("*", tool)):
            d = self._samples(key)
            if d is not None:
                return self._quantile(d)
        return self.params.tool_priors_s.get(tool, self.params.prior_s)

    def predict(self, tenant: str, tools: Sequence[str]) -> float:
        if not tools:
            return self.params.prior_s
        return max(self.predict_tool(tenant, t) for t in tools)

    def observe(self, tenant: str, tools: Sequence[str], duration_s: float, predicted_s: float) -> bool:
        """Record a finished wait (shared by its tools); True when it overran its prediction."""
        if duration_s < 0:
            return False
        for t in set(tools) or {"*"}:
            for key in ((tenant, t), ("*", t)):
                d = self._recent.get(key)
                if d is None:
                    d = self._recent[key] = deque(maxlen=self.params.window)
                d.append(duration_s)
                self._recent.move_to_end(key)
        while len(self._recent) > self.params.max_keys:
            self._recent.popitem(last=False)
        self.observed += 1
        over = duration_s > predicted_s
        self.overruns += over
        return over

    def plan(self, tenant: str, tools: Sequence[str], now: float) -> WaitPlan:
        p = self.params
        predicted = self.predict(tenant, tools)
        if predicted <= p.reserve_max_s:
            return WaitPlan(predicted, "reserve", now + predicted * p.deadline_factor)
        return self._release(predicted, now)

    def released(self, plan: WaitPlan, start: float) -> WaitPlan:
        """``plan``, for a wait that began at ``start``, as a long wait's: the KV released and prefetched
        before the predicted resume. What a short wait becomes when its tenant's parked-KV budget cannot
        hold it: the session then reloads from the CPU tier rather than recomputing, and the prefetch
        takes node CPU memory, not the GPU memory the budget protects."""
        return self._release(plan.predicted_s, start)

    def _release(self, predicted: float, start: float) -> WaitPlan:
        resume = start + predicted
        return WaitPlan(predicted, "release", resume, max(start, resume - self.params.prefetch_lead_s))

    def snapshot(self) -> Mapping[str, object]:
        return {"keys": len(self._recent), "observed": self.observed, "overruns": self.overruns,
                "params": self.params.model_dump()}
