"""Injected clocks, so the simulator and benchmarks can run production code in virtual time."""

from __future__ import annotations

import asyncio
import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Seconds on a monotonic timeline."""
        ...

    async def sleep(self, seconds: float) -> None: ...


class MonotonicClock:
    """Wall time, optionally sped up (a simulated engine at speed 10 runs ten times faster)."""

    def __init__(self, speed: float = 1.0) -> None:
        if speed <= 0:
            raise ValueError("speed must be > 0")
        self._speed = speed
        self._origin = time.monotonic()

    def now(self) -> float:
        return (time.monotonic() - self._origin) * self._speed

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds) / self._speed)


class VirtualClock:
    """Time that only moves when told to: the discrete-event driver owns it."""

    def __init__(self, start: float = 0.0) -> None:
        self._t = start

    def now(self) -> float:
        return self._t

    def advance_to(self, t: float) -> None:
        if t < self._t:
            raise ValueError(f"virtual time cannot go back ({t} < {self._t})")
        self._t = t

    async def sleep(self, seconds: float) -> None:
        # Virtual sleeps complete immediately; the driver moves time explicitly.
        self._t += max(0.0, seconds)
        await asyncio.sleep(0)
