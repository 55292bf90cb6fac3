"""One what-if run: a request log replayed through kvgate's router and session controller on simulated
engines in virtual time (``sim/sessions.py``), with the gateway's settings as the log's header records
them, changed by a candidate's overrides; and what it measured, beside what the log recorded."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from pydantic import BaseModel

from kvgate.router.cost import CostParams
from kvgate.session.prefill import PrefillParams
from kvgate.session.waits import WaitParams
from kvgate.sim.sessions import SessionFleet
from kvgate.sim.sessiontypes import MODES, Setup, TurnResult
from kvgate.sim.timing import TimingProfile, get_profile
from kvgate.tune.log import LogError, LogSession

SECTIONS: dict[str, type[BaseModel]] = {"cost": CostParams, "waits": WaitParams, "prefill": PrefillParams}
"""What ``PATCH /admin/policy`` changes at run time, by section."""
SETTINGS = ("cpu_tier_ttl_s",)
"""Settings a candidate may change that only a restart applies (printed as configuration)."""

Overrides = dict[str, Any]
"""``{"cost": {field: value}, "waits": {...}, "prefill": {...}, "cpu_tier_ttl_s": x}``."""


def parse_overrides(text: str) -> Overrides:
    """``cost.backlog_weight=0.5,waits.reserve_max_s=2`` as overrides (values validated later)."""
    out: Overrides = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"{item!r}: expected SECTION.FIELD=VALUE")
        section, _, name = key.strip().partition(".")
        v: Any = float(value) if value.strip().replace(".", "", 1).replace("-", "", 1).isdigit() \
            else value.strip()
        if section in SECTIONS and name:
            out.setdefault(section, {})[name] = v
        elif section in SETTINGS and not name:
            out[section] = float(v)
        else:
            raise ValueError(f"{key!r}: expected one of {', '.join(f'{s}.FIELD' for s in SECTIONS)}, "
                             f"{', '.join(SETTINGS)}")
    return out


@dataclass(frozen=True, slots=True)
class Fleet:
    """What the replay's fleet is: from the log's header, with a timing profile."""

    profile: TimingProfile
    workers: int
    per_node: int
    setup: Setup
    base: Mapping[str, Any]
    """The gateway's settings as the header recorded them."""
    hidden_tokens: int = 0
    """Output tokens a reasoning parser hides before the first visible output (the gateway's TTFT)."""

    @classmethod
    def from_header(cls, header: Mapping[str, Any], model: str, block_size: int, profile: str,
                    speed: float = 1.0) -> Fleet:
        """``speed``: the workers ran the profile this many times faster (``kvgate sim --speed``)."""
        workers = [w for w in header.get("workers", []) if w.get("model") == model]
        if not workers:
            raise LogError(f"the log's header names no worker of model {model!r}")
        p = get_profile(profile)
        cap = min((int(w.get("kv_capacity_tokens") or 0) for w in workers), default=0)
        p = replace(p, block_size=block_size or p.block_size,
                    num_blocks=cap // block_size if cap and block_size else p.num_blocks)
        if speed != 1.0:
            p = replace(p, **{k: getattr(p, k) / speed for k in ("p0", "p1", "p2", "p_attn", "d_min", "d0", "d1",
                                                                 "d2", "d_seq", "d_ctx")})
        nodes = [w.get("node") or w["id"] for w in workers]
        per_node = max(nodes.count(n) for n in nodes)
        setup = Setup(True, True, True) if header.get("tiers") else MODES["gateway"]
        return cls(p, len(workers), per_node, setup, header)

    def settings(self, over: Overrides) -> dict[str, Any]:
        """The candidate's settings: the header's, with ``over`` applied and validated."""
        out: dict[str, Any] = {}
        for name, model in SECTIONS.items():
            out[name] = model.model_validate({**dict(self.base.get(name) or {}), **over.get(name, {})})
        for name in SETTINGS:
            out[name] = float(over.get(name, self.base.get(name, 300.0)))
        return out

    def run(self, sessions: Sequence[LogSession], over: Overrides) -> Outcome:
        s = self.settings(over)
        prefill: PrefillParams = s["prefill"]
        fleet = SessionFleet(self.profile, self.workers, self.per_node, self.setup, prefill=prefill.enabled,
                             waits=s["waits"], prefill_params=prefill, cost=s["cost"],
                             cpu_tier_ttl_s=s["cpu_tier_ttl_s"], hidden_tokens=self.hidden_tokens)
        results = fleet.run(sessions)
        return Outcome.of(fleet, results)


def _pct(xs: Sequence[float], q: float) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


@dataclass(frozen=True, slots=True)
class Outcome:
    requests: int
    prompt_tokens: int
    cached_tokens: int
    ttft_p50_ms: float
    ttft_p99_ms: float
    ttft_mean_ms: float
    recomputed_tokens: int
    prefill_waste_tokens: int
    kv_parked_tokens: float
    """Mean KV held reserved for sessions waiting on tools (tokens, over the replay's span)."""
    ttft_ms: Mapping[tuple[str, int], float] = field(default_factory=dict, compare=False)
    """Per request (conversation, index): its TTFT."""

    @property
    def reuse(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @classmethod
    def of(cls, fleet: SessionFleet, results: Sequence[TurnResult]) -> Outcome:
        ttft = [r.ttft_ms for r in results if r.first_token is not None]
        ps = fleet.prefill_stats
        span = max((r.finish or 0.0 for r in results), default=0.0) - min((r.arrival for r in results), default=0.0)
        return cls(len(results), sum(r.prompt for r in results), sum(max(0, r.reuse) for r in results),
                   _pct(ttft, 0.5), _pct(ttft, 0.99), statistics.fmean(ttft) if ttft else 0.0,
                   sum(r.recomputed for r in results), round(fleet.bg_computed * ps.waste_fraction),
                   fleet.parked_token_s / span if span > 0 else 0.0,
                   {(r.session, r.round): r.ttft_ms for r in results if r.first_token is not None})


def recorded(sessions: Sequence[LogSession]) -> Outcome:
    """What the log says the gateway measured for the same requests (TTFT: streams only)."""
    turns = [t.e for s in sessions for t in s.turns]
    ttft = [e.ttft * 1000 for e in turns if e.ttft is not None]
    usage = [e.usage for e in turns if e.usage is not None]
    return Outcome(len(turns), sum(u[0] for u in usage), sum(u[1] for u in usage), _pct(ttft, 0.5),
                   _pct(ttft, 0.99), statistics.fmean(ttft) if ttft else 0.0, 0, 0, 0.0,
                   {(s.id, i): t.e.ttft * 1000 for s in sessions for i, t in enumerate(s.turns)
                    if t.e.ttft is not None})
