"""How late this process's event loop runs, and what follows from it.

Under overload kvgate's own loop falls behind: a callback that should run now runs 200 ms later. Every
timer on it is late by as much — including the connect and health-check timeouts that judge the workers.
Measured on issue 25's load (150 req/s on one core): kvgate's connect timeout fired on its late loop and
ejected a healthy worker, so overload became "no healthy worker" for everyone. So a timeout that elapsed
while the loop was late by a fair part of it is kvgate's, not the worker's (``blames_loop``), and a loop
that stays late sheds new requests with a 503 and Retry-After before it spends anything on them
(``overloaded``), instead of making every admitted request slower.

A ticker sleeps ``interval_s`` and records by how much it overslept; the record keeps the worst of each
``bucket_s`` for ``window_s``. Pure but for ``run``: time comes in as arguments.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Iterator

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

BLAME_FRACTION = 0.25
"""A timeout whose window saw the loop late by at least this fraction of it is the loop's: at that
lateness, the timer itself and the socket events around it ran that much behind."""


class LoopLag:
    def __init__(self, interval_s: float = 0.02, bucket_s: float = 0.25, window_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self._bucket_s = bucket_s
        self._buckets: deque[tuple[float, float]] = deque(maxlen=max(1, int(window_s / bucket_s)))
        self._clock = clock
        self.now_late_s = 0.0
        """The lateness of the last tick."""

    def record(self, at: float, late_s: float) -> None:
        self.now_late_s = late_s
        start = at - at % self._bucket_s
        if self._buckets and self._buckets[-1][0] == start:
            if late_s > self._buckets[-1][1]:
                self._buckets[-1] = (start, late_s)
        else:
            self._buckets.append((start, late_s))

    def worst(self, now: float, within_s: float) -> float:
        """The worst lateness recorded in the last ``within_s``."""
        since = now - within_s - self._bucket_s
        return max((late for start, late in self._buckets if start >= since), default=0.0)

    def recent(self, within_s: float) -> float:
        """The worst lateness recorded in the last ``within_s`` until now."""
        return self.worst(self._clock(), within_s)

    def blames_loop(self, timeout_s: float) -> bool:
        """Whether a timeout of ``timeout_s`` that just fired is better blamed on this loop than the peer."""
        return self.worst(self._clock(), timeout_s) >= BLAME_FRACTION * timeout_s

    def overloaded(self, threshold_s: float, hold_s: float = 0.5) -> bool:
        """The loop ran later than ``threshold_s`` within the last ``hold_s``: shedding holds that long
        once it starts, so the load that made the loop late has time to drain instead of flapping."""
        return self.worst(self._clock(), hold_s) > threshold_s

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + self.interval_s
            await asyncio.sleep(self.interval_s)
            self.record(self._clock(), max(0.0, loop.time() - due))


LAG_WINDOW_S = 10.0
"""What the lag gauge reports: the worst of the last this many seconds (a scrape every 15 s still sees a
stall that lasted a moment, which an instantaneous reading would miss)."""


class LoopLagCollector(Collector):
    """``kvgate_event_loop_lag_seconds``: how late this process's loop ran lately — the first sign that a
    replica is past what one core serves (docs/operations.md, "Overload and the workers' health")."""

    def __init__(self, lag: LoopLag) -> None:
        self._lag = lag

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily("kvgate_event_loop_lag_seconds", "The worst lateness of this process's event "
                                f"loop over the last {LAG_WINDOW_S:g} s (a 20 ms ticker's oversleep).",
                                value=self._lag.recent(LAG_WINDOW_S))
