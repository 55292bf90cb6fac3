"""A synthetic agent workload: sessions of user turns, each a chain of reasoning + tool call rounds with
heavy-tailed tool waits, ending in an answer and a user think time.

Every session is a script fixed by its seed (segments of token ids and the waits between requests);
the fleet driver (``bench/tiering.py``) plays it closed-loop: a session's next request is sent when its
previous response has ended plus the scripted wait. The distributions and where their parameters come
from are in ``AgentParams`` and docs/tiering.md.

Token ids are random per segment (a segment never repeats inside or across sessions), except the
system prompts, which a few agent types share, as agents of one product do.
"""

from __future__ import annotations

import math
import random
from array import array
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    weight: float
    median_s: float
    sigma: float
    """Log-normal wait: ``median · exp(sigma · N(0,1))``."""


@dataclass(frozen=True, slots=True)
class AgentParams:
    """Defaults and their sources (docs/tiering.md has the derivation): ``Cat.`` is the agentic-otel
    workload catalog (data/agentic-otel, 10,056 traces), ``SWE`` the SWE-agent trajectories,
    ``anchor`` the 86% < 1 s / 95% < 10 s return-time figure in anchors.md, ``A`` an assumption."""

    sessions: int = 240
    start_window_s: float = 600.0
    """Sessions start uniformly over this window."""
    agent_types: int = 8
    system_tokens: int = 2_100
    """SWE: the first prompt (system + task) is ~2.1k tokens; one per agent type, shared."""
    interactive_continue_p: float = 0.85
    oneshot_continue_p: float = 0.10
    """Half of the agent types are interactive (a user keeps talking), half one-shot task agents; the
    mix gives ~0.48 per user turn, what the catalog's 21.9 calls per session implies (A for the split)."""
    user_turns_max: int = 12
    rounds_mean: float = 10.0
    """Tool rounds per user turn: 1 + geometric with this mean (SWE: 10.8 tool calls per task, 4–21)."""
    rounds_max: int = 25
    user_tokens: tuple[float, float] = (120.0, 0.8)
    """(median, sigma) of a log-normal, in tokens (A)."""
    tool_result_tokens: tuple[float, float] = (75.0, 2.08)
    """SWE observations, chars/4: p50 75, p90 1.1k tokens; 8k cap."""
    tool_result_cap: int = 8_000
    call_tokens: tuple[float, float] = (60.0, 0.6)
    answer_tokens: tuple[float, float] = (138.0, 1.0)
    """Cat. output length median 138 (its sigma 1.77 narrowed: answers, not file dumps)."""
    answer_cap: int = 4_000
    heavy_fraction: float = 0.6
    """Sessions whose reasoning is several times longer than the answer."""
    heavy_reasoning_tokens: tuple[float, float] = (900.0, 0.8)
    light_reasoning_tokens: tuple[float, float] = (150.0, 0.8)
    """SWE: thought text is 2.6x (aggregate) to 4.9x (median step) the action text (A: as tokens)."""
    think_time: tuple[float, float] = (45.0, 2.0)
    think_cap_s: float = 7_200.0
    """User think time, s: log-normal fitted with the tool mixture to the catalog's mean gap 13.0 s and
    sd 176 s; the cap is the catalog's max gap (A: the median and sigma)."""
    tools: tuple[Tool, ...] = (
        Tool("open_file", 0.25, 0.2, 0.64),
        Tool("grep", 0.20, 0.2, 0.64),
        Tool("python", 0.18, 0.3, 0.64),
        Tool("edit_file", 0.18, 0.7, 0.64),
        Tool("run_tests", 0.10, 3.0, 1.2),
        Tool("pip_install", 0.05, 3.0, 1.2),
        Tool("web_search", 0.04, 3.0, 1.2),
    )
    """Fast tools (81%): SWE per-tool execution_time medians, sigma 0.64 (SWE MLE). Slow tools (19%):
    median 3 s, sigma 1.2 (A), weight solved so that 86% of waits are < 1 s and 95% < 10 s (anchor)."""
    max_context_tokens: int = 40_000
    """A session ends after the user turn in which its history passes this (agents start over or
    compact; the served context is bounded by ``max_model_len``)."""
    seed: int = 7


@dataclass(slots=True)
class Round:
    """One request of a session and what it generates."""

    wait_s: float
    """Time between the previous response's end and this request (0 for the first)."""
    kind: str
    """``user`` (a new user turn) or ``tool`` (resumes after tool results)."""
    appended: list[int]
    """Tokens this request adds to the history (user message or tool result)."""
    reasoning: list[int]
    visible: list[int]
    """The tool call or the answer."""
    tools: tuple[str, ...] = ()
    """Tools the response calls (empty for an answer)."""
    turn: int = 0


@dataclass(slots=True)
class SessionScript:
    id: str
    start_s: float
    heavy: bool
    system: list[int]
    agent_type: str = ""
    rounds: list[Round] = field(default_factory=list)


class _Tokens:
    """Fresh token ids: every segment is unique (no accidental prefix sharing)."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def take(self, n: int) -> list[int]:
        # 16-bit ids from the seeded generator's bytes: fast, and a 64-token block of them never repeats.
        return list(array("H", self.rng.randbytes(2 * max(1, n))))


def _lognormal(rng: random.Random, median: float, sigma: float) -> float:
    return median * math.exp(sigma * rng.gauss(0.0, 1.0))


def _ltok(rng: random.Random, ms: tuple[float, float], cap: int | None = None) -> int:
    n = max(1, int(_lognormal(rng, *ms)))
    return min(n, cap) if cap else n


def generate(p: AgentParams) -> list[SessionScript]:
    rng = random.Random(p.seed)
    toks = _Tokens(rng)
    systems = [toks.take(p.system_tokens) for _ in range(p.agent_types)]
    interactive = [i % 2 == 0 for i in range(p.agent_types)]
    names = [t.name for t in p.tools]
    weights = [t.weight for t in p.tools]
    by_name = {t.name: t for t in p.tools}
    out: list[SessionScript] = []
    for i in range(p.sessions):
        heavy = rng.random() < p.heavy_fraction
        kind = rng.randrange(p.agent_types)
        cont = p.interactive_continue_p if interactive[kind] else p.oneshot_continue_p
        s = SessionScript(f"agent-{i}", rng.uniform(0, p.start_window_s), heavy, systems[kind], f"type-{kind}")
        reasoning = p.heavy_reasoning_tokens if heavy else p.light_reasoning_tokens
        wait = 0.0
        size = len(s.system)  # the history, as the next turn will render it (reasoning dropped)
        for turn in range(p.user_turns_max):
            if size > p.max_context_tokens:
                break
            rounds = min(p.rounds_max, 1 + _geometric(rng, p.rounds_mean))
            role, appended = "user", toks.take(_ltok(rng, p.user_tokens))
            for r in range(rounds):
                last = r == rounds - 1
                if last:
                    s.rounds.append(Round(wait, role, appended, toks.take(_ltok(rng, reasoning)),
                                          toks.take(_ltok(rng, p.answer_tokens, p.answer_cap)), (), turn))
                    break
                n_calls = 1 + _poisson(rng, 0.52)  # Cat.: 1.52 tool calls per tool-calling call
                called = tuple(rng.choices(names, weights, k=n_calls))
                s.rounds.append(Round(wait, role, appended, toks.take(_ltok(rng, reasoning)),
                                      toks.take(_ltok(rng, p.call_tokens) * n_calls), called, turn))
                wait = max(_lognormal(rng, by_name[t].median_s, by_name[t].sigma) for t in called)
                role = "tool"
                appended = toks.take(sum(_ltok(rng, p.tool_result_tokens, p.tool_result_cap) for _ in called))
            size += sum(len(r.appended) + len(r.visible) for r in s.rounds if r.turn == turn)
            if rng.random() >= cont:
                break
            wait = min(p.think_cap_s, _lognormal(rng, *p.think_time))
        out.append(s)
    return out


def _geometric(rng: random.Random, mean_extra: float) -> int:
    """Extra rounds: geometric on {0, 1, ...} with the given mean."""
    if mean_extra <= 0:
        return 0
    q = mean_extra / (1 + mean_extra)
    n = 0
    while rng.random() < q:
        n += 1
    return n


def _poisson(rng: random.Random, lam: float) -> int:
    n, t = 0, rng.expovariate(1.0)
    while t < lam:
        n += 1
        t += rng.expovariate(1.0)
    return n


def canonical_history(s: SessionScript, upto: int) -> list[int]:
    """The prompt of round ``upto``: system, then every round's appended tokens and output, with the
    reasoning of earlier user turns dropped (the Qwen3 rule: reasoning before the last user query is
    not rendered) and the current turn's reasoning kept (a tool chain sees its own reasoning)."""
    turn = s.rounds[upto].turn
    out = list(s.system)
    for j in range(upto):
        r = s.rounds[j]
        out += r.appended
        if r.turn == turn:
            out += r.reasoning
        out += r.visible
    out += s.rounds[upto].appended
    return out


def next_turn_prefix(s: SessionScript, last: int) -> list[int]:
    """What the next user turn will start with after round ``last`` (an answer): the whole history with
    this turn's reasoning dropped too."""
    out = list(s.system)
    for j in range(last + 1):
        r = s.rounds[j]
        out += r.appended + r.visible
    return out
