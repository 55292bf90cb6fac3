"""What kvgate reads from a worker's ``/metrics``: load, KV capacity, the hashing setup it publishes and
when its process started. Pure: text in, ``EngineMetrics`` out."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

# Engine metric names for (running, waiting, kv usage).
LOAD_METRICS = {
    "vllm": ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"),
    "sim": ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"),
    "sglang": ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage"),
}


@dataclass(frozen=True, slots=True)
class EngineMetrics:
    """What kvgate reads from a worker's ``/metrics`` (None: not published)."""

    running: int | None = None
    waiting: int | None = None
    kv_usage: float | None = None
    num_gpu_blocks: int | None = None
    kv_block_size: int | None = None
    """The scheduler's block size (KV capacity = blocks x this)."""
    hash_block_size: int | None = None
    """Tokens per prefix-cache block hash: vLLM's ``hash_block_size`` when set, else its block size."""
    hash_algo: str | None = None
    """``prefix_caching_hash_algo``."""
    started_at: float | None = None
    """``process_start_time_seconds``: changes when the worker's process restarts."""


def _int_label(labels: dict[str, str], name: str) -> int | None:
    v = labels.get(name, "")
    return int(v) if v.isdigit() and int(v) > 0 else None


def parse_metrics(text: str, engine: str) -> EngineMetrics:
    """Parse a Prometheus exposition. vLLM 0.32 publishes its whole CacheConfig as the labels of
    ``vllm:cache_config_info`` (``block_size``, ``hash_block_size``, ``prefix_caching_hash_algo``,
    ``num_gpu_blocks``, ...) and the process collector's ``process_start_time_seconds``."""
    names = LOAD_METRICS.get(engine)
    values: dict[str, float] = {}
    info: dict[str, str] | None = None
    started: float | None = None
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            if names is not None and sample.name in names:
                values[sample.name] = values.get(sample.name, 0.0) + sample.value
            elif sample.name == "vllm:cache_config_info" and info is None:
                info = dict(sample.labels)
            elif sample.name == "process_start_time_seconds" and math.isfinite(sample.value):
                started = sample.value

    def finite(v: float) -> float:
        return v if math.isfinite(v) else 0.0

    load: dict[str, Any] = {}
    if names is not None and values:
        load = {"running": int(finite(values.get(names[0], 0.0))), "waiting": int(finite(values.get(names[1], 0.0))),
                "kv_usage": finite(values.get(names[2], 0.0))}
    if info is None:
        return EngineMetrics(**load, started_at=started)
    bs = _int_label(info, "block_size")
    algo = info.get("prefix_caching_hash_algo") or None
    return EngineMetrics(**load, num_gpu_blocks=_int_label(info, "num_gpu_blocks"), kv_block_size=bs,
                         hash_block_size=_int_label(info, "hash_block_size") or bs, hash_algo=algo,
                         started_at=started)
