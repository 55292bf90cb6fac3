"""The gateway's Prometheus metrics, in a registry owned by one app instance (no globals)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from kvgate.gateway.app import Gateway

_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class GatewayMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.route_decisions = Counter("kvgate_route_decisions", "Routing decisions by policy and reason.",
                                       ["policy", "reason"], registry=r)
        self.requests = Counter("kvgate_requests", "Requests answered, by endpoint and status.",
                                ["endpoint", "status"], registry=r)
        self.upstream_failures = Counter("kvgate_upstream_failures",
                                         "Worker failures seen by the proxy, by worker and kind.",
                                         ["worker", "kind"], registry=r)
        self.retries = Counter("kvgate_retries", "Requests retried on another worker.", registry=r)
        self.client_disconnects = Counter("kvgate_client_disconnects",
                                          "Requests whose client went away (upstream cancelled).", registry=r)
        self.conversation_source = Counter("kvgate_conversation_id_source",
                                           "How each request's conversation was identified.", ["source"],
                                           registry=r)
        self.prompt_tokens = Counter("kvgate_prompt_tokens", "Prompt tokens reported by workers.", ["worker"],
                                     registry=r)
        self.cached_tokens = Counter("kvgate_cached_tokens", "Prompt tokens served from the prefix cache.",
                                     ["worker"], registry=r)
        self.completion_tokens = Counter("kvgate_completion_tokens", "Completion tokens reported by workers.",
                                         ["worker"], registry=r)
        self.missing_usage = Counter("kvgate_missing_usage", "Responses that carried no usage.", registry=r)
        self.ttft = Histogram("kvgate_ttft_seconds", "Time to first token seen by the gateway.", ["model"],
                              buckets=_TTFT_BUCKETS, registry=r)
        self.worker_healthy = Gauge("kvgate_worker_healthy", "1 if the worker is eligible for routing.",
                                    ["worker"], registry=r)
        self.worker_in_flight = Gauge("kvgate_worker_in_flight", "Requests kvgate has in flight per worker.",
                                      ["worker"], registry=r)
        self.sessions = Gauge("kvgate_sessions", "Conversations held in the session store.", registry=r)
        self.session_store_errors = Counter("kvgate_session_store_errors",
                                            "Session store calls that failed (requests were still served).",
                                            registry=r)
        self.prompt_source = Counter("kvgate_prompt_tokens_source",
                                     "Where each request's tokens came from: local, worker, estimate.",
                                     ["source"], registry=r)
        self.expected_vs_actual = Histogram(
            "kvgate_expected_vs_actual_cached_tokens",
            "Cached tokens the worker reported minus those the routing decision expected.", ["policy"],
            buckets=(-8192, -2048, -512, -128, -1, 0, 127, 511, 2047, 8191), registry=r)
        self.tokens_lost = Counter("kvgate_prefix_tokens_lost",
                                   "History tokens that could have been reused and were not, by cause.", ["cause"],
                                   registry=r)
        self.restored = Counter("kvgate_history_restored",
                                "Assistant messages restored to their exact form, by what the client changed.",
                                ["field"], registry=r)
        self.expected_cached = Counter("kvgate_expected_cached_tokens",
                                       "Cached tokens the routing decisions expected.", ["policy"], registry=r)
        self.tool_waits = Counter("kvgate_tool_waits", "Tool waits that ended, by outcome against their "
                                  "prediction (within, overrun) and reservations that lapsed.", ["outcome"], registry=r)
        self.wait_plans = Counter("kvgate_wait_plans", "Tool waits by plan: reserve or release.", ["action"],
                                  registry=r)
        self.tier_lookups = Counter("kvgate_tier_lookups", "Tier residency lookups, by tier and whether it "
                                    "answered (down: treated as empty).", ["tier", "state"], registry=r)
        self.prefetches = Counter("kvgate_tier_prefetches", "LMCache prefetches asked for.", ["outcome"], registry=r)
        self.prefill_decisions = Counter("kvgate_prefill_decisions", "Background prefill decisions by reason.",
                                         ["reason"], registry=r)
        self.prefills = Counter("kvgate_prefills", "Background prefills: issued, completed, failed, used, wasted.",
                                ["outcome"], registry=r)


class PrefixCollector(Collector):
    """KV event and index figures, read at scrape time from the gateway's prefix knowledge."""

    def __init__(self, gw: Gateway) -> None:
        self._gw = gw

    def collect(self) -> Iterator[Metric]:
        st = self._gw.prefix.events.stats
        for name, doc, value in (
            ("kvgate_kv_events_applied", "KV events applied to the prefix index.", st.applied),
            ("kvgate_kv_event_batches", "KV event batches received.", st.batches),
            ("kvgate_kv_event_batches_malformed", "KV event batches that could not be decoded.", st.malformed),
            ("kvgate_kv_event_gaps", "Sequence gaps detected (batches lost).", st.gaps),
            ("kvgate_kv_event_publisher_restarts", "Publishers that restarted (sequence reset).", st.restarts),
            ("kvgate_kv_event_replays_failed", "Gaps that replay could not fill (worker index dropped).",
             st.replays_failed),
            ("kvgate_kv_events_unknown_worker", "Event batches from workers kvgate does not know.",
             st.unknown_worker),
        ):
            c = CounterMetricFamily(name, doc)
            c.add_metric([], value)
            yield c
        g = GaugeMetricFamily("kvgate_index_blocks", "Blocks the index holds per worker and tier.",
                              labels=["worker", "tier", "mode"])
        for mode, idx in (("precise", self._gw.prefix.index), ("approximate", self._gw.prefix.approx.index)):
            for w, tiers in idx.snapshot().items():
                for tier, n in tiers.items():
                    g.add_metric([w, tier, mode], n)
        yield g
        p = CounterMetricFamily("kvgate_tokenizer_parity_failures", "Local tokenizer disagreed with a worker.",
                                labels=["model"])
        for m, n in self._gw.prompts.parity_failures.items():
            p.add_metric([m], n)
        yield p
