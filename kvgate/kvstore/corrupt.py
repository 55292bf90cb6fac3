"""Corrupt values the shared stores found in Redis: each logged once, counted by key kind, and dropped
or replaced by the store that found it (``redis_conversations.py``, ``redis_fleet.py``, ``capacity.py``).

Redis is shared with whatever else can write to it (an operator's ``redis-cli``, a script, a bug in
another version): a value kvgate cannot read is never a reason to fail a request, stop a background
loop or keep a conversation from being recorded. ``/metrics`` shows
``kvgate_store_corrupt_records_total{kind}`` (``CorruptCollector``).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable, Iterator

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

KINDS = ("conversation", "response_id", "timer", "timer_token", "observation", "reservation", "parked",
         "slot_estimate")
"""Every kind of key kvgate's shared stores own (docs/hostile-input.md)."""


class Corruption:
    """The corrupt values one store found. A value is reported once however often it is read before it
    is replaced (every request of a conversation reads its record until a turn rewrites it)."""

    def __init__(self, remember: int = 4096) -> None:
        self.counts: dict[str, int] = dict.fromkeys(KINDS, 0)
        self._seen: OrderedDict[tuple[str, str, str], None] = OrderedDict()
        self._remember = remember

    def found(self, kind: str, key: str, reason: str) -> None:
        seen = (kind, key, reason)
        if seen in self._seen:
            self._seen.move_to_end(seen)
            return
        self._seen[seen] = None
        while len(self._seen) > self._remember:
            self._seen.popitem(last=False)
        self.counts[kind] = self.counts.get(kind, 0) + 1
        log.warning("corrupt %s in the shared store at %r (%s): dropped, or replaced on its next write", kind,
                    key[:200], reason[:300])


class CorruptCollector(Collector):
    """``kvgate_store_corrupt_records_total{kind}``: the corrupt values the stores of this process found."""

    def __init__(self, sources: Iterable[Corruption]) -> None:
        self._sources = tuple(sources)

    def collect(self) -> Iterator[Metric]:
        m = CounterMetricFamily("kvgate_store_corrupt_records", "Values in the shared store kvgate could not "
                                "read (corrupt, wrong Redis type), by key kind: dropped or replaced.",
                                labels=["kind"])
        for kind in KINDS:
            m.add_metric([kind], sum(s.counts.get(kind, 0) for s in self._sources))
        yield m
