"""The simulated engine's ``/metrics``, under vLLM's own metric names and labels."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvgate.sim.engine import EngineCore


class EngineCollector(Collector):
    """Reads the engine's state at scrape time, so nothing has to be kept in step with it."""

    def __init__(self, core: EngineCore, model: str, aborted: Callable[[], int],
                 started_at: Callable[[], float] | None = None) -> None:
        self._core = core
        self._labels = {"model_name": model, "engine": "0"}
        self._aborted = aborted
        self._started_at = started_at

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
        if self._started_at is not None:
            # prometheus_client's process collector under the same name, but per simulated engine: several
            # simulators in one process (the tests) must each show their own restart, as vLLM processes do.
            yield GaugeMetricFamily("process_start_time_seconds", "Start time of the process since unix epoch "
                                    "in seconds.", value=self._started_at())
        running, waiting = core.step_stats()
        yield self._g("vllm:num_requests_running", "Requests in model execution batches.", running)
        yield self._g("vllm:num_requests_waiting", "Requests waiting to be processed.", waiting)
        yield self._g("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                      core.pool.usage())
        yield self._c("vllm:prefix_cache_queries", "Prefix cache queries, in terms of tokens.",
                      s.prefix_cache_queries)
        yield self._c("vllm:prefix_cache_hits", "Prefix cache hits, in terms of tokens.", s.prefix_cache_hits)
        yield self._c("vllm:prompt_tokens_cached", "Cached prompt tokens.", s.prefix_cache_hits)
        yield self._c("vllm:prompt_tokens", "Number of prefill tokens processed.", s.prompt_tokens)
        yield self._c("vllm:generation_tokens", "Number of generation tokens processed.", s.generation_tokens)
        yield self._c("vllm:num_preemptions", "Cumulative number of preemptions.", s.preemptions)
        # The labels kvgate learns a worker's hashing from, as vLLM 0.32 writes them (its whole CacheConfig).
        cfg = {"block_size": str(core.block_size), "hash_block_size": "None", "enable_prefix_caching": "True",
               "num_gpu_blocks": str(core.pool.num_blocks),
               "prefix_caching_hash_algo": getattr(core.hasher, "algo", ""), "engine": "0"}
        info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                 labels=list(cfg))
        info.add_metric(list(cfg.values()), 1.0)
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


class SglangCollector(Collector):
    """SGLang 0.5.23's names and labels (``srt/observability/metrics_collector.py``): scheduler gauges
    labelled ``model_name, engine_type, tp_rank, pp_rank, moe_ep_rank``, tokenizer counters ``model_name,
    engine_type`` (+ ``is_streaming`` / ``cache_source``). ``token_usage`` counts cached pages nobody uses
    as free, as SGLang does (evictable)."""

    def __init__(self, core: EngineCore, model: str, aborted: Callable[[], int],
                 started_at: Callable[[], float] | None = None) -> None:
        self._core = core
        self._started_at = started_at
        self._sched = {"model_name": model, "engine_type": "unified", "tp_rank": "0", "pp_rank": "0",
                       "moe_ep_rank": "0"}
        self._tok = {"model_name": model, "engine_type": "unified"}
        self._aborted = aborted

    def _g(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=list(self._sched))
        g.add_metric(list(self._sched.values()), value)
        return g

    def _c(self, name: str, doc: str, value: float, **extra: str) -> CounterMetricFamily:
        labels = {**self._tok, **extra}
        c = CounterMetricFamily(name, doc, labels=list(labels))
        c.add_metric(list(labels.values()), value)
        return c

    def collect(self) -> Iterator[Metric]:
        core, s = self._core, self._core.stats
        hit = s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0
        if self._started_at is not None:  # as EngineCollector: one start time per simulated engine
            yield GaugeMetricFamily("process_start_time_seconds", "Start time of the process since unix epoch "
                                    "in seconds.", value=self._started_at())
        running, waiting = core.step_stats()
        yield self._g("sglang:num_running_reqs", "The number of running requests.", running)
        yield self._g("sglang:num_queue_reqs", "The number of requests in the waiting queue.", waiting)
        yield self._g("sglang:token_usage", "The token usage.", round(core.pool.usage(), 2))
        yield self._g("sglang:cache_hit_rate", "The prefix cache hit rate.", hit)
        yield self._g("sglang:page_size", "The page size.", core.block_size)
        yield self._g("sglang:max_total_num_tokens", "Maximum total tokens.", core.pool.num_blocks * core.block_size)
        yield self._c("sglang:prompt_tokens", "Number of prefill tokens processed.", s.prompt_tokens,
                      is_streaming="false")
        yield self._c("sglang:generation_tokens", "Number of generation tokens processed.", s.generation_tokens,
                      is_streaming="false")
        cached = CounterMetricFamily("sglang:cached_tokens", "Number of cached prompt tokens by source "
                                     "(device/host/storage).", labels=[*self._tok, "cache_source"])
        cached.add_metric([*self._tok.values(), "device"], s.prefix_cache_hits)
        cached.add_metric([*self._tok.values(), "host"], s.loaded_cpu_tokens)
        yield cached
        host_total = getattr(core.pool, "host_blocks", 0) * core.block_size
        if host_total:
            yield self._g("sglang:hicache_host_used_tokens", "HiCache host pool tokens in use.",
                          getattr(core.pool, "host_used", 0) * core.block_size)
            yield self._g("sglang:hicache_host_total_tokens", "HiCache host pool capacity in tokens.", host_total)
        yield self._c("sglang:num_requests", "Number of requests processed.", s.finished, is_streaming="false")
        yield self._c("sglang:num_aborted_requests", "Number of requests aborted.", self._aborted())
        yield self._c("sglang:num_retracted_requests", "Number of retracted requests.", s.preemptions)
