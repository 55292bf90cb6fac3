"""One worker's health: a state machine with hysteresis and a half-open state. Pure: the pool feeds it
outcomes (active checks and what requests saw) and reads whether the worker may take traffic.

    unknown ──ok──▶ up ──fall consecutive failures, or one hard failure──▶ down
                    ▲                                                      │ ok (the active probe)
                    └───────────ok─────────── probation ◀──────────────────┘
                                                  │ any failure
                                                  ▼
                                                 down

- one slow or failed ``/health`` is one soft failure: a worker leaves only after ``fall`` in a row (as
  HAProxy's ``fall`` / Envoy's consecutive-failure outlier detection), and any success resets the count;
- a hard failure ejects at once: the connection was refused, nothing listens there;
- an ejected worker is probed by the active check; a success lets it back on probation (half-open): it
  takes traffic, and a single failure ejects it again; the next success makes it ``up``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Health(StrEnum):
    UNKNOWN = "unknown"
    """Not checked yet (a worker that just joined): no traffic."""
    UP = "up"
    DOWN = "down"
    PROBATION = "probation"


@dataclass(slots=True)
class HealthTracker:
    fall: int = 3
    """Consecutive soft failures that eject an ``up`` worker."""
    state: Health = Health.UNKNOWN
    failures: int = 0
    """Consecutive failures so far."""
    ever_up: bool = False
    ejections: int = 0

    @property
    def eligible(self) -> bool:
        return self.state in (Health.UP, Health.PROBATION)

    def success(self) -> bool:
        """A check passed or a request got its answer. True when an ejected worker that had been up is
        let back (the caller must treat it as possibly restarted)."""
        self.failures = 0
        readmitted = self.state is Health.DOWN and self.ever_up
        if self.state is Health.DOWN and self.ever_up:
            self.state = Health.PROBATION
        elif self.state is not Health.UP:
            self.state = Health.UP
        self.ever_up = True
        return readmitted

    def failure(self, hard: bool = False) -> bool:
        """A check or a request failed. True when this failure ejected the worker."""
        self.failures += 1
        if self.state is Health.DOWN:
            return False
        if hard or self.state is not Health.UP or self.failures >= self.fall:
            self.state = Health.DOWN
            self.ejections += 1
            return True
        return False
