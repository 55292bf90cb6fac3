"""Workloads in the Mooncake trace format, generated from the agent data in ``data/``, so every router —
kvgate's and Dynamo's own replay — runs them like the Mooncake traces.

Two generators, each a list of sessions turned into requests (docs/routing.md has the derivation):

- ``agentic``: the synthetic agent sessions of ``bench/agents.py`` (user turns, each a chain of
  reasoning + tool-call rounds with heavy-tailed tool waits and user think time), whose parameters are
  fitted to the agentic-otel workload catalog (``data/agentic-otel``: 21.9 calls a session, 13 s
  between calls, tool waits) and the SWE-agent tool timings. A round's prompt is the session's
  canonical history (reasoning of earlier user turns dropped, as Qwen3's template renders it).
- ``swe``: the 22 real SWE-agent trajectories (``data/swe-agent-trajectories``), message by message: the
  prompt of the k-th model call is the history before the k-th assistant message, its output that
  message; tokens are characters / 4. Sessions start as a Poisson process and each replays one
  trajectory (uniformly drawn); the system prompt is shared by the sessions whose agent configuration
  has the same one, everything after it is the session's own (tasks differ).

Block ids follow Mooncake's rule: the prompt is cut into 512-token chunks and a chunk's id names the
whole prefix up to its end (equal ids at a position = equal prefix), the last chunk possibly partial.

Arrivals are open-loop, as in a Mooncake trace: a session's next call arrives at the previous call's
arrival + a nominal service time (its uncached prefill on an idle worker plus its output at one
decode step a token, from the engine's timing profile) + the scripted wait (tool run or think time).
A router that serves faster than nominal does not pull the next call earlier, one that serves slower
does not push it later; the trace fixes what every router is given.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from kvgate.bench.agents import AgentParams, SessionScript, generate
from kvgate.bench.data import SWE_TRAJECTORIES, read_text
from kvgate.bench.trace import TraceRequest
from kvgate.sim.timing import TimingProfile, get_profile

CHUNK = 512
Segment = tuple[object, int]
"""A stretch of prompt: a key naming its content (equal keys = equal tokens) and its length."""


@dataclass(frozen=True, slots=True)
class Call:
    """One model call of a session: its prompt as segments, its output length, and the wait after the
    previous call's response before it is sent."""

    segments: tuple[Segment, ...]
    output: int
    wait_s: float


@dataclass(frozen=True, slots=True)
class Session:
    start_s: float
    calls: tuple[Call, ...]


class ChunkIds:
    """Mooncake-style chained chunk ids: one id per distinct (prefix id, chunk content)."""

    def __init__(self, chunk: int = CHUNK) -> None:
        self.chunk = chunk
        self._ids: dict[tuple[int, tuple[tuple[object, int, int], ...]], int] = {}

    def ids(self, segments: Sequence[Segment]) -> list[int]:
        out: list[int] = []
        pieces: list[tuple[object, int, int]] = []
        fill, parent = 0, -1
        for key, n in segments:
            off = 0
            while off < n:
                take = min(n - off, self.chunk - fill)
                pieces.append((key, off, off + take))
                off += take
                fill += take
                if fill == self.chunk:
                    parent = self._intern(parent, pieces)
                    out.append(parent)
                    pieces, fill = [], 0
        if pieces:
            out.append(self._intern(parent, pieces))
        return out

    def _intern(self, parent: int, pieces: list[tuple[object, int, int]]) -> int:
        return self._ids.setdefault((parent, tuple(pieces)), len(self._ids))


def nominal_ms(profile: TimingProfile, prompt: int, cached: int, output: int) -> float:
    """An idle worker's time for a call whose first ``cached`` tokens are in its KV."""
    new = max(1, prompt - cached)
    prefill, done = 0.0, cached
    while new > 0:  # chunked prefill, one budget-sized pass at a time
        take = min(new, profile.max_num_batched_tokens)
        prefill += profile.prefill_ms([(take, done)])
        done, new = done + take, new - take
    return prefill + output * profile.decode_ms(1, prompt)


def to_trace(sessions: Sequence[Session], profile: TimingProfile | None = None) -> list[TraceRequest]:
    profile = profile or get_profile("dynamo-mocker")
    ids = ChunkIds()
    timed: list[tuple[float, int, int, tuple[int, ...]]] = []
    for s in sessions:
        t, prior, last = s.start_s, 0, (0, 0, 0)
        for i, c in enumerate(s.calls):
            prompt = sum(n for _, n in c.segments)
            if i:
                t += nominal_ms(profile, *last) / 1000.0 + c.wait_s
            timed.append((t, prompt, c.output, tuple(ids.ids(c.segments))))
            last, prior = (prompt, min(prompt, prior), c.output), prompt
    timed.sort(key=lambda x: x[0])
    t0 = timed[0][0] if timed else 0.0
    return [TraceRequest(i, round(t - t0, 3), p, max(1, o), h) for i, (t, p, o, h) in enumerate(timed)]


# -- agentic: the synthetic agent sessions --------------------------------------------------------
AGENTIC = AgentParams(sessions=240, start_window_s=900.0, max_context_tokens=48_000)
"""The catalog's sessions, ~15 minutes of them (the Mooncake conversation trace's half-hour at a
comparable computed-token rate for 8 workers)."""


def agentic_sessions(params: AgentParams) -> list[Session]:
    out = []
    for s in generate(params):
        out.append(Session(s.start_s, tuple(_agent_calls(s))))
    return out


def _agent_calls(s: SessionScript) -> list[Call]:
    calls = []
    for upto, r in enumerate(s.rounds):
        segs: list[Segment] = [(id(s.system), len(s.system))]
        for j in range(upto):
            p = s.rounds[j]
            segs.append((id(p.appended), len(p.appended)))
            if p.turn == r.turn:
                segs.append((id(p.reasoning), len(p.reasoning)))
            segs.append((id(p.visible), len(p.visible)))
        segs.append((id(r.appended), len(r.appended)))
        calls.append(Call(tuple(segs), len(r.reasoning) + len(r.visible), r.wait_s))
    return calls


def agentic(seed: int = 7, params: AgentParams = AGENTIC) -> list[TraceRequest]:
    return to_trace(agentic_sessions(replace(params, seed=seed)))


# -- swe: the SWE-agent trajectories ---------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Trajectory:
    system: str
    messages: tuple[tuple[str, int], ...]
    """(role, tokens) after the system message."""


def _tokens(text: str) -> int:
    return max(1, len(text) // 4) + 4  # + the chat template's few tokens around a message


def load_trajectories(folder: Path = SWE_TRAJECTORIES) -> list[Trajectory]:
    out = []
    for f in sorted(folder.glob("*.traj*")):
        hist = json.loads(read_text(f)).get("history") or []
        system = next((str(m["content"]) for m in hist if m.get("role") == "system"), "")
        msgs = tuple((str(m.get("role")), _tokens(str(m.get("content") or ""))) for m in hist
                     if m.get("role") != "system")
        if any(r == "assistant" for r, _ in msgs):
            out.append(Trajectory(system, msgs))
    return out


@dataclass(frozen=True, slots=True)
class SweParams:
    sessions: int = 900
    window_s: float = 900.0
    """Sessions start as a Poisson process over this window."""
    seed: int = 7


def swe_sessions(p: SweParams, trajectories: Sequence[Trajectory] | None = None) -> list[Session]:
    trajs = list(trajectories or load_trajectories())
    rng = random.Random(p.seed)
    tools = AgentParams().tools  # the SWE per-tool execution times (docs/tiering.md)
    names, weights = [t.name for t in tools], [t.weight for t in tools]
    out, t = [], 0.0
    for n in range(p.sessions):
        t += rng.expovariate(p.sessions / p.window_s)
        traj = rng.choice(trajs)
        sys_key = ("system", traj.system)
        calls: list[Call] = []
        for k, (role, out_tokens) in enumerate(traj.messages):
            if role != "assistant":
                continue
            segs: list[Segment] = [(sys_key, _tokens(traj.system))]
            segs += [((n, i), toks) for i, (_, toks) in enumerate(traj.messages[:k])]
            name = rng.choices(names, weights)[0]
            tool = next(x for x in tools if x.name == name)
            wait = tool.median_s * math.exp(tool.sigma * rng.gauss(0.0, 1.0)) if calls else 0.0
            calls.append(Call(tuple(segs), out_tokens, wait))
        out.append(Session(t, tuple(calls)))
    return out


def swe(seed: int = 7, params: SweParams = SweParams()) -> list[TraceRequest]:
    return to_trace(swe_sessions(replace(params, seed=seed)))


def describe(trace: Sequence[TraceRequest]) -> str:
    """One line of what a workload is: requests, span, mean input/output, input token rate."""
    if not trace:
        return "empty"
    span = max(r.arrival_s for r in trace) - min(r.arrival_s for r in trace)
    inp = sum(r.input_length for r in trace)
    return (f"{len(trace):,} requests over {span / 60:.1f} min, mean input {inp / len(trace):,.0f} tokens, "
            f"mean output {sum(r.output_length for r in trace) / len(trace):,.0f}, "
            f"{inp / max(span, 1e-9):,.0f} input tokens/s")
