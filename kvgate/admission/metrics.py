"""Admission's figures on /metrics, read at scrape time from the gate (no tenant label: refusals by reason
only, so a tenant count cannot grow the series)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvgate.admission.gate import Admission
from kvgate.admission.slotsync import SlotSync


class AdmissionCollector(Collector):
    def __init__(self, gate: Admission) -> None:
        self._gate = gate

    def collect(self) -> Iterator[Metric]:
        r = CounterMetricFamily("kvgate_admission_rejections", "Requests admission refused, by reason: the "
                                "tenant limit (429) or queue_full / queue_timeout (503).", labels=["reason"])
        for reason, n in sorted(self._gate.rejected.items()):
            r.add_metric([reason], n)
        yield r
        q = GaugeMetricFamily("kvgate_admission_queued", "Requests waiting for a slot on this replica.",
                              labels=["model"])
        b = GaugeMetricFamily("kvgate_admission_slots_busy", "Slots held by admitted requests on this replica.",
                              labels=["model"])
        for model in self._gate.models():
            q.add_metric([model], self._gate.queued(model))
            b.add_metric([model], self._gate.busy(model))
        yield q
        yield b


class SlotSyncCollector(Collector):
    """How this replica's learned caps and the fleet's met (``admission/slotsync.py``)."""

    def __init__(self, sync: SlotSync) -> None:
        self._sync = sync

    def collect(self) -> Iterator[Metric]:
        s = self._sync
        yield CounterMetricFamily("kvgate_slot_estimates_published", "Learned engine caps this replica wrote "
                                  "to the shared store.", value=s.published)
        yield CounterMetricFamily("kvgate_slot_estimates_adopted", "Engine caps taken from another replica's "
                                  "newer reading (a joiner's first ones before it serves).", value=s.adopted)
        yield CounterMetricFamily("kvgate_slot_estimates_failures", "Rounds of sharing the learned caps that "
                                  "failed (the store down: each replica learns its own).", value=s.failures)
