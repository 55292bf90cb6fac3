"""The simulated worker's settings: ``KVGATE_SIM_*`` env vars and the YAML file ``KVGATE_SIM_CONFIG`` names."""

from __future__ import annotations

import os
from typing import ClassVar, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from kvgate.config import YamlSettings
from kvgate.sim.timing import PROFILES


class SimSettings(YamlSettings):
    model_config = SettingsConfigDict(env_prefix="KVGATE_SIM_", extra="forbid")
    config_env_var: ClassVar[str] = "KVGATE_SIM_CONFIG"

    engine: Literal["vllm", "sglang"] = "vllm"
    """Which engine's wire formats, prefix cache and KV events to imitate (``kinds.py``, ``dialects.py``)."""
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
    priority_scheduling: bool = False
    """Honour a request's ``priority`` (vLLM ``--scheduling-policy priority``, SGLang
    ``--enable-priority-scheduling``): one below the default runs as a background request."""
    hicache_ratio: float | None = Field(None, gt=0)
    """SGLang only: a HiCache host tier of this many times the device pages (``--enable-hierarchical-cache
    --hicache-ratio``), write-through (``hicache.py``)."""
    api_key: str | None = None
    """vLLM's ``--api-key``: a /v1 request without ``Authorization: Bearer <key>`` gets 401."""
    enable_cache_report: bool = True
    """SGLang's ``--enable-cache-report`` (``usage.prompt_tokens_details``); vLLM always reports here."""

    @model_validator(mode="after")
    def _hicache_is_sglangs(self) -> SimSettings:
        if self.hicache_ratio is not None and self.engine != "sglang":
            raise ValueError("hicache_ratio needs engine: sglang (vLLM's host tier is LMCache)")
        return self

    @field_validator("profile")
    @classmethod
    def _known_profile(cls, v: str) -> str:
        if v not in PROFILES:
            raise ValueError(f"unknown profile {v!r}; expected one of {sorted(PROFILES)}")
        return v
