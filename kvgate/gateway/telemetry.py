"""The gateway's Prometheus metrics, in a registry owned by one app instance (no globals)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

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
