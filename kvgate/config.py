"""Configuration: pydantic-settings models read from ``KVGATE_*`` env vars and an optional YAML file.

Precedence: explicit arguments > environment > YAML file > defaults. Everything is validated at start;
``format_validation_error`` turns a failure into one line per bad field.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import ClassVar, Literal
from urllib.parse import urlparse

from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)

from kvgate.gateway.prefill import PrefillParams
from kvgate.router.cost import CostParams
from kvgate.router.waits import WaitParams

EngineKind = Literal["vllm", "sglang", "sim"]
PolicyName = Literal["round_robin", "least_loaded", "session_affinity", "cost_model"]


class WorkerConfig(BaseModel):
    url: str
    model: str = Field(min_length=1)
    engine: EngineKind = "vllm"
    id: str = ""
    """Stable name used in metrics and decisions; defaults to host:port."""
    block_size: int = Field(16, gt=0)
    """The engine's KV block size (vLLM: 16 on GPU, 128 on CPU)."""
    hash_algo: Literal["sha256", "sha256_cbor"] = "sha256"
    """The engine's ``--prefix-caching-hash-algo``."""
    kv_events: str | None = None
    """ZMQ endpoint of the worker's KV events (tcp://host:port); ``auto`` asks its /kv_event_sources;
    none: kvgate routes on what it sent there (approximate mode)."""
    kv_replay: str | None = None
    node: str = ""
    """Workers on one node share its LMCache L1 (CPU tier); "" is a node of its own."""
    lmcache_url: str | None = None
    """HTTP API of the LMCache server this worker uses (multiprocess mode), for prefetches."""
    lmcache_model: str | None = None
    """The ``--model`` path the worker was started with: LMCache names its keys after it."""
    kv_capacity_tokens: int = Field(0, ge=0)
    """GPU KV capacity in tokens, to price reservations (0: from vllm:cache_config_info, else unpriced)."""

    @field_validator("url")
    @classmethod
    def _http_url(cls, v: str) -> str:
        u = urlparse(v)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"worker url must be http(s)://host[:port], got {v!r}")
        return v.rstrip("/")

    @model_validator(mode="after")
    def _default_id(self) -> WorkerConfig:
        if not self.id:
            u = urlparse(self.url)
            self.id = f"{u.hostname}:{u.port or (443 if u.scheme == 'https' else 80)}"
        return self


class _YamlSettings(BaseSettings):
    """Adds the YAML file named by an env var (``KVGATE_CONFIG``, ``KVGATE_SIM_CONFIG``) as a source."""

    config_env_var: ClassVar[str] = "KVGATE_CONFIG"

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        path = os.environ.get(cls.config_env_var)
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        if path:
            if not Path(path).is_file():
                raise FileNotFoundError(f"{cls.config_env_var}={path}: no such file")
            sources.append(YamlConfigSettingsSource(settings_cls, yaml_file=path))
        return tuple(sources)


class GatewaySettings(_YamlSettings):
    model_config = SettingsConfigDict(env_prefix="KVGATE_", extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    workers: list[WorkerConfig] = Field(default_factory=list)
    policy: PolicyName = "cost_model"
    affinity_epsilon: float = Field(0.25, ge=0.0, le=10.0)
    """Bounded load: a worker above (1+epsilon)·mean load takes no more sessions."""
    conversation_headers: list[str] = Field(default_factory=lambda: ["x-conversation-id", "x-session-id"])
    tenant_header: str = "x-tenant-id"
    max_body_bytes: int = Field(8 * 1024 * 1024, ge=1024)
    max_attempts: int = Field(2, ge=1, le=10)
    """Workers tried for one request when they fail before the first byte."""
    health_interval_s: float = Field(5.0, gt=0)
    health_timeout_s: float = Field(2.0, gt=0)
    upstream_connect_timeout_s: float = Field(3.0, gt=0)
    upstream_read_timeout_s: float = Field(600.0, gt=0)
    retry_after_s: int = Field(1, ge=0)
    drain_timeout_s: float = Field(30.0, ge=0)
    session_ttl_s: float = Field(3600.0, gt=0)
    max_sessions: int = Field(100_000, ge=1)
    session_store: Literal["memory", "redis"] = "memory"
    redis_url: str = "redis://127.0.0.1:6379/0"
    tokenizers: dict[str, str] = Field(default_factory=dict)
    """Model name -> local tokenizer directory (tokenizer.json + tokenizer_config.json). Models without
    one are tokenized by a worker's /tokenize."""
    hash_seed: str | None = Field(default_factory=lambda: os.environ.get("PYTHONHASHSEED"))
    """The workers' PYTHONHASHSEED (vLLM derives its root block hash from it)."""
    approx_ttl_s: float = Field(120.0, gt=0)
    """Approximate mode: how long a routed prompt is assumed to stay cached on its worker."""
    cost: CostParams = Field(default_factory=CostParams)
    """Cost-model parameters; tunable at run time through PATCH /admin/policy."""
    protocols: dict[str, str] = Field(default_factory=dict)
    """Model name -> protocol profile (generic-vllm, qwen3, deepseek-v3, deepseek-r1, gpt-oss, kimi-k2,
    kvgate-tiny); a model named like a profile uses it, others generic-vllm."""
    reasoning_policy: str = "keep"
    """What a completed turn's reasoning becomes in later requests: keep, drop or truncate:N."""
    tenant_reasoning_policies: dict[str, str] = Field(default_factory=dict)
    tier_redis_url: str | None = None
    """The Redis LMCache uses as L2; set to check a prompt's remote-tier residency before routing."""
    tier_chunk_tokens: int = Field(256, gt=0)
    """LMCache's chunk size."""
    tier_probe_timeout_s: float = Field(0.05, gt=0)
    tier_retry_s: float = Field(5.0, gt=0)
    """After a tier error, treat it as empty for this long before trying again."""
    cpu_tier_ttl_s: float = Field(300.0, gt=0)
    """How long a node's LMCache L1 is assumed to keep the chunks kvgate sent it."""
    waits: WaitParams = Field(default_factory=WaitParams)
    """Tool-wait prediction and the reserve/release rule."""
    prefill: PrefillParams = Field(default_factory=lambda: PrefillParams(enabled=False))
    """Background prefill of the canonical branch (off unless enabled)."""
    prefill_priority: int | None = None
    """vLLM request priority for background prefills (needs --scheduling-policy priority); None sends none."""
    max_tracked_conversations: int = Field(10_000, ge=0)
    """Conversations whose prompt tokens and block hashes are kept for incremental hashing."""

    @field_validator("conversation_headers")
    @classmethod
    def _lower(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError("at least one conversation header is needed")
        return [h.strip().lower() for h in v]

    @field_validator("reasoning_policy")
    @classmethod
    def _policy(cls, v: str) -> str:
        from kvgate.gateway.protocols import ReasoningPolicy

        return str(ReasoningPolicy.parse(v))

    @field_validator("tenant_reasoning_policies")
    @classmethod
    def _tenant_policies(cls, v: dict[str, str]) -> dict[str, str]:
        from kvgate.gateway.protocols import ReasoningPolicy

        return {t: str(ReasoningPolicy.parse(p)) for t, p in v.items()}

    @field_validator("protocols")
    @classmethod
    def _protocols(cls, v: dict[str, str]) -> dict[str, str]:
        from kvgate.gateway.protocols import get_protocol

        for p in v.values():
            get_protocol(p)
        return v

    @model_validator(mode="after")
    def _unique_ids(self) -> GatewaySettings:
        ids = [w.id for w in self.workers]
        dup = {i for i in ids if ids.count(i) > 1}
        if dup:
            raise ValueError(f"duplicate worker ids: {sorted(dup)}")
        return self


class SimSettings(_YamlSettings):
    model_config = SettingsConfigDict(env_prefix="KVGATE_SIM_", extra="forbid")
    config_env_var: ClassVar[str] = "KVGATE_SIM_CONFIG"

    host: str = "127.0.0.1"
    port: int = Field(8100, ge=0, le=65535)
    model: str = "kvgate-tiny"
    model_dir: str | None = None
    """Tokenizer and template directory; default: the tiny model, built on first use."""
    profile: str = "cpu-tiny"
    block_size: int | None = Field(None, gt=0)
    num_blocks: int | None = Field(None, gt=0)
    max_num_seqs: int | None = Field(None, gt=0)
    max_model_len: int = Field(4096, gt=0)
    hash_algo: Literal["sha256", "sha256_cbor"] = "sha256"
    hash_seed: str | None = Field(default_factory=lambda: os.environ.get("PYTHONHASHSEED"))
    speed: float = Field(1.0, gt=0)
    """Timing model speed-up: 10 runs every step ten times faster than the profile says."""
    kv_events_endpoint: str | None = None
    kv_replay_endpoint: str | None = None
    kv_events_topic: str = ""

    @field_validator("profile")
    @classmethod
    def _known_profile(cls, v: str) -> str:
        from kvgate.sim.timing import PROFILES

        if v not in PROFILES:
            raise ValueError(f"unknown profile {v!r}; expected one of {sorted(PROFILES)}")
        return v


def format_validation_error(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "(settings)"
        lines.append(f"  {loc}: {err['msg']}" + (f" (got {err['input']!r})" if "input" in err and
                                                   not isinstance(err["input"], dict) else ""))
    return "invalid configuration:\n" + "\n".join(lines)
