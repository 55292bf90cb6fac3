"""The simulated engine's ``/metrics``, under vLLM's own metric names and labels."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvgate.sim.engine import EngineCore


class EngineCollector(Collector):
    """Reads the engine's state at scrape time, so nothing has to be kept in step with it."""

    def __init__(self, core: EngineCore, model: str, aborted: Callable[[], int]) -> None:
        self._core = core
        self._labels = {"model_name": model, "engine": "0"}
        self._aborted = aborted

    def _g(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=list(self._labels))
        g.add_metric(list(self._labels.values()), value)
        return g

    def _c(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=list(self._labels))
        c.add_metric(list(self._labels.values()), value)
        return c

    def collect(self) -> Iterator[Metric]:
        core, s = self._core, self._core.stats
        yield self._g("vllm:num_requests_running", "Requests in model execution batches.", core.num_running)
        yield self._g("vllm:num_requests_waiting", "Requests waiting to be processed.", core.num_waiting)
        yield self._g("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                      core.pool.usage())
        yield self._c("vllm:prefix_cache_queries", "Prefix cache queries, in terms of tokens.",
                      s.prefix_cache_queries)
        yield self._c("vllm:prefix_cache_hits", "Prefix cache hits, in terms of tokens.", s.prefix_cache_hits)
        yield self._c("vllm:prompt_tokens_cached", "Cached prompt tokens.", s.prefix_cache_hits)
        yield self._c("vllm:prompt_tokens", "Number of prefill tokens processed.", s.prompt_tokens)
        yield self._c("vllm:generation_tokens", "Number of generation tokens processed.", s.generation_tokens)
        yield self._c("vllm:num_preemptions", "Cumulative number of preemptions.", s.preemptions)
        info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                 labels=["block_size", "num_gpu_blocks"])
        info.add_metric([str(core.block_size), str(core.pool.num_blocks)], 1.0)
        yield info
        src = CounterMetricFamily("vllm:prompt_tokens_by_source", "Prompt tokens by source.",
                                  labels=[*self._labels, "source"])
        src.add_metric([*self._labels.values(), "local_cache_hit"], s.prefix_cache_hits)
        src.add_metric([*self._labels.values(), "local_compute"], s.computed_prefill_tokens)
        yield src
        done = CounterMetricFamily("vllm:request_success", "Finished requests by reason.",
                                   labels=[*self._labels, "finished_reason"])
        done.add_metric([*self._labels.values(), "stop"], s.finished)
        done.add_metric([*self._labels.values(), "abort"], self._aborted())
        yield done
