"""Configuration: pydantic-settings models read from ``KVGATE_*`` env vars and an optional YAML file.

Precedence: explicit arguments > environment > YAML file > defaults. Everything is validated at start;
``format_validation_error`` turns a failure into one line per bad field.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, ClassVar, Literal
from urllib.parse import urlparse

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)

from kvgate.admission.settings import AdmissionSettings
from kvgate.router.cost import CostParams
from kvgate.session.prefill import PrefillParams
from kvgate.session.waits import WaitParams
from kvgate.settings.auth import AuthSettings
from kvgate.settings.epp import EppAuthSettings, check_startup
from kvgate.settings.limits import HostileSettings

EngineKind = Literal["vllm", "sglang", "sim"]
PolicyName = Literal["round_robin", "least_loaded", "session_affinity", "cost_model"]


class WorkerTemplate(BaseModel):
    """What kvgate is told of a worker beyond its address: a static worker's settings, or those discovery
    gives every worker it finds."""

    # Unknown keys anywhere stop start-up: a typo (`kv_event:`) would otherwise run the worker silently
    # without the setting it meant.
    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(None, min_length=1)
    engine: EngineKind = "vllm"
    block_size: int = Field(16, gt=0)
    """The engine's KV block size (vLLM: 16 on GPU, 128 on CPU)."""
    hash_algo: Literal["sha256", "sha256_cbor"] = "sha256"
    """The engine's ``--prefix-caching-hash-algo``. Block size and algorithm are learned from the worker's
    ``vllm:cache_config_info`` when it publishes them; a configured value that disagrees is logged and
    counted (``kvgate_worker_config_mismatches_total``) and the worker's value is used."""
    hash_seed: str | None = None
    """The worker's ``PYTHONHASHSEED``; None: the gateway-wide ``hash_seed``. vLLM does not publish it."""
    kv_events: str | None = None
    """ZMQ endpoint of the worker's KV events (tcp://host:port); ``auto`` asks its /kv_event_sources;
    none: kvgate routes on what it sent there (approximate mode). In a discovery template ``{host}``
    stands for the address found."""
    kv_replay: str | None = None
    node: str = ""
    """Workers on one node share its LMCache L1 (CPU tier); "" is a node of its own."""
    lmcache_url: str | None = None
    """HTTP API of the LMCache server this worker uses (multiprocess mode), for prefetches."""
    lmcache_model: str | None = None
    """The ``--model`` path the worker was started with: LMCache names its keys after it."""
    lmcache_instance: str | None = None
    """The ``--instance-id`` of that LMCache server, as the coordinator (``tier_coordinator_url``) names it."""
    kv_capacity_tokens: int = Field(0, ge=0)
    """GPU KV capacity in tokens, to price reservations (0: from vllm:cache_config_info, else unpriced)."""


class WorkerConfig(WorkerTemplate):
    url: str
    model: str = Field(min_length=1)
    id: str = ""
    """Stable name used in metrics and decisions; defaults to host:port."""

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


class DnsDiscovery(BaseModel):
    """Workers behind a DNS name, re-resolved every ``interval_s`` (a Kubernetes headless Service)."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["dns"] = "dns"
    name: str = Field(min_length=1)
    """``vllm.ns.svc.cluster.local`` for its A/AAAA records, ``_http._tcp.vllm.ns.svc.cluster.local`` for SRV."""
    record: Literal["A", "SRV"] = "A"
    """A: A and AAAA records of ``name``, each on ``port``; SRV: targets and ports from the SRV records."""
    port: int = Field(8000, gt=0, le=65535)
    interval_s: float = Field(10.0, gt=0)
    nameservers: list[str] = Field(default_factory=list)
    """``ip`` or ``ip:port``; empty: the system's resolver configuration."""
    timeout_s: float = Field(2.0, gt=0)
    worker: WorkerTemplate
    """Settings of every worker found (``model`` is required)."""

    @model_validator(mode="after")
    def _model(self) -> DnsDiscovery:
        if not self.worker.model:
            raise ValueError("discovery.worker.model is required for DNS discovery")
        return self


class KubernetesDiscovery(BaseModel):
    """Workers from the Kubernetes API: EndpointSlices (or Pods) by label selector, watched, relisted every
    ``resync_s``. Readiness comes from the API; ports by name; pod annotations ``kvgate.io/model``,
    ``kvgate.io/engine``, ``kvgate.io/kv-events``, ``kvgate.io/kv-replay`` override the template (Pods)."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["kubernetes"] = "kubernetes"
    resource: Literal["endpointslices", "pods"] = "endpointslices"
    namespace: str = "default"
    label_selector: str = Field(min_length=1)
    """EndpointSlices: e.g. ``kubernetes.io/service-name=vllm``; Pods: e.g. ``app=vllm``."""
    port_name: str = "http"
    kv_events_port_name: str | None = "kv-events"
    kv_replay_port_name: str | None = "kv-replay"
    resync_s: float = Field(300.0, gt=0)
    worker: WorkerTemplate = Field(default_factory=WorkerTemplate)


Discovery = Annotated[DnsDiscovery | KubernetesDiscovery, Field(discriminator="kind")]


class YamlSettings(BaseSettings):
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


class GatewaySettings(YamlSettings):
    # Attribute docstrings become the fields' descriptions: `kvgate serve --help` prints their first line.
    model_config = SettingsConfigDict(env_prefix="KVGATE_", extra="forbid", use_attribute_docstrings=True)

    host: str = "127.0.0.1"
    """Listen address of the HTTP API (and of the gRPC and ext_proc ports)."""
    port: int = Field(8000, ge=0, le=65535)
    """Listen port of the OpenAI API, /health, /ready, /metrics and /admin/*; 0 picks a free one."""
    processes: int = Field(1, ge=1, le=64)
    """Gateway processes in this pod, on one port (``kvgate serve --workers N``): one is one core. Above
    1 they share state through Redis, so ``session_store: redis`` is required (docs/operations.md)."""
    workers: list[WorkerConfig] = Field(default_factory=list)
    """The static list of workers; with ``discovery`` set, workers it finds join these."""
    discovery: Discovery | None = None
    """Where to find workers besides the static list: ``{kind: dns, ...}`` or ``{kind: kubernetes, ...}``."""
    policy: PolicyName = "cost_model"
    """Routing policy."""
    affinity_epsilon: float = Field(0.25, ge=0.0, le=10.0)
    """Bounded load: a worker above (1+epsilon)·mean load takes no more sessions."""
    conversation_headers: list[str] = Field(default_factory=lambda: ["x-conversation-id"])
    """kvgate's own headers that name the conversation, in order; ahead of every other key."""
    harness_session_keys: bool = True
    """Also take the conversation from the agent harnesses' session headers (Claude Code, Codex, OpenCode,
    ``x-session-id``) and the bodies' ``session_id`` / ``prompt_cache_key`` / ``metadata.user_id``, with
    sub-agents as conversations of their own (kvgate/gateway/identity.py, docs/protocols.md)."""
    thinking_signature_secret: SecretStr | None = None
    """Key of the signatures on the thinking blocks the Messages door returns (HMAC-SHA256 of the text),
    checked when a client sends a block back; unset: ``auth.cache_salt_secret``, else a built-in key (edits
    are still caught, forgeries are not). The same on every replica (docs/protocols.md)."""
    regroup_derived: bool = True
    """Clients that send no key: find their conversation again after a compaction or rewind by the messages
    it kept (session/regroup.py, docs/protocols.md), instead of starting a new one under a new derived key."""
    tenant_header: str = "x-tenant-id"
    """Auth off only: with auth on, the tenant is the credential's and this header is ignored."""
    auth: AuthSettings = Field(default_factory=AuthSettings)
    """Authentication, roles and tenant isolation (kvgate/gateway/auth.py, docs/security.md)."""
    admission: AdmissionSettings = Field(default_factory=AdmissionSettings)
    """Per-tenant quotas (concurrency, requests and tokens per minute) and the fair queue for the fleet's
    slots; off by default (kvgate/admission/, docs/admission.md)."""
    max_body_bytes: int = Field(8 * 1024 * 1024, ge=1024)
    """Request bodies larger than this get 413."""
    hostile: HostileSettings = Field(default_factory=HostileSettings)
    """Limits on hostile or oversized input: JSON depth and numbers, prompt tokens (docs/hostile-input.md)."""
    engine_token_ids: bool = True
    """Ask vLLM workers for the prompt and output token ids of chat responses (``return_token_ids``) so
    the loss explanation compares what the engine really cached; kept out of the client's response unless
    it asked. Sent only when every worker of the model is a vLLM one."""
    max_attempts: int = Field(2, ge=1, le=10)
    """Workers tried for one request when they never got it (refused connection, failed write); of those
    that answered 502/503/504, two at most (kvgate/gateway/send.py)."""
    health_interval_s: float = Field(5.0, gt=0)
    """Active checks (``/health`` and ``/metrics``) every this long; an ejected worker is probed as often."""
    health_timeout_s: float = Field(2.0, gt=0)
    """An active check slower than this counts as failed."""
    eject_after_failures: int = Field(3, ge=1)
    """Consecutive failures (slow or failed checks, requests that timed out, 502/503/504, broken streams)
    that take a worker out; a refused connection does at once, and so does any failure on probation
    (the first requests after an ejected worker's probe succeeded)."""
    upstream_connect_timeout_s: float = Field(3.0, gt=0)
    """Connecting to a worker."""
    upstream_read_timeout_s: float = Field(600.0, gt=0)
    """Between two reads of a worker's answer."""
    upstream_keepalive_s: float = Field(4.0, gt=0)
    """How long an idle connection to a worker is kept for reuse: under the workers' own keep-alive
    timeout (vLLM's and SGLang's uvicorn: 5 s), so kvgate never sends on a connection the worker is closing
    (the keep-alive race: a 502 for a request no worker saw)."""
    overload_shed_lag_ms: float | None = Field(None, gt=0)
    """Refuse new requests (503 ``overloaded``, Retry-After) while kvgate's own event loop runs later than
    this (gateway/looplag.py); None: never. 20–50 keeps admitted requests' added latency bounded when the
    offered load exceeds what one process serves (docs/operations.md)."""
    upstream_client: Literal["httptools", "aiohttp", "httpx"] = "httptools"
    """The HTTP client that carries proxied requests to the workers: kvgate's own on httptools' parser
    (gateway/h1client.py), or aiohttp or httpx, kept to compare (docs/routing.md measures the three)."""
    retry_after_s: int = Field(1, ge=0)
    """``Retry-After`` on a 503."""
    drain_timeout_s: float = Field(30.0, ge=0)
    """On SIGTERM /ready turns 503 and in-flight requests get this long to finish."""
    session_ttl_s: float = Field(3600.0, gt=0)
    """A conversation not seen this long is forgotten."""
    max_sessions: int = Field(100_000, ge=1)
    """Memory store: conversations kept (least recently used first out)."""
    max_store_bytes: int = Field(1 << 30, ge=1 << 20)
    """Memory store: bytes of conversation records kept, all conversations together."""
    max_conversation_bytes: int = Field(4 << 20, ge=1 << 14)
    """One conversation's record: over it, its chain, then its oldest exact replies, then its history go."""
    session_store: Literal["memory", "redis"] = "memory"
    """Where conversations live: ``redis`` shares them between gateway replicas."""
    redis_url: str = "redis://127.0.0.1:6379/0"
    """The Redis of ``session_store: redis`` (and of the admission store)."""
    redis_cluster: bool = False
    """``redis_url`` names a Redis Cluster node: each conversation's keys share one hash slot."""
    redis_prefix: str = Field("kvgate:", min_length=1)
    """Prefix of every key kvgate writes in Redis."""
    timer_tick_s: float = Field(0.1, gt=0, le=10)
    """How often a replica claims due timers and reads the fleet's new observations."""
    timer_lease_s: float = Field(60.0, gt=0)
    """A claimed timer (and the background prefill it runs) is this replica's for this long; if the
    replica dies, another one runs it after the lease."""
    template_sandbox: bool = False
    """Render chat templates in Jinja's sandbox (as transformers and vLLM do for templates from a hub).
    The templates kvgate renders come from the model directories configured in ``tokenizers``, as trusted
    as this configuration; requests only ever reach them as data. Rendering without the sandbox takes half
    the time (on a 32k-token history 0.40 ms against 0.74 ms): turn it on for templates from elsewhere."""
    tokenizers: dict[str, str] = Field(default_factory=dict)
    """Model name -> local tokenizer directory (tokenizer.json + tokenizer_config.json). Models without
    one are tokenized by a worker's /tokenize."""
    hash_seed: str | None = Field(default_factory=lambda: os.environ.get("PYTHONHASHSEED"))
    """The workers' PYTHONHASHSEED (vLLM derives its root block hash from it)."""
    approx_ttl_s: float = Field(120.0, gt=0)
    """Approximate mode: how long a routed prompt is assumed to stay cached on its worker."""
    routed_record_poll_s: float = Field(0.25, ge=0)
    """Approximate mode with ``session_store=redis``: how often a replica publishes what it routed and
    merges what the other replicas routed (``kvstore/routed.py``); 0: each knows only its own routes."""
    inflight_ttl_s: float = Field(30.0, gt=0)
    """Workers with KV events: a prompt dispatched there counts as cached there until its blocks arrive by
    events, nothing kvgate sent there is in flight, or this long has passed."""
    kv_events_warm_start: bool = True
    """Replay each worker's KV event buffer when kvgate subscribes, so a gateway that starts knows the
    workers' caches before its first request (off: only from each worker's next event on)."""
    kv_events_sync_timeout_s: float = Field(5.0, ge=0)
    """How long start-up waits for those first replays before serving anyway."""
    cost: CostParams = Field(default_factory=CostParams)
    """Cost-model parameters; tunable at run time through PATCH /admin/policy."""
    protocols: dict[str, str] = Field(default_factory=dict)
    """Model name -> protocol profile (generic-vllm, qwen3, deepseek-v3, deepseek-r1, gpt-oss, kimi-k2,
    kvgate-tiny); a model named like a profile uses it, others generic-vllm."""
    reasoning_policy: str = "keep"
    """What a completed turn's reasoning becomes in later requests: keep, drop or truncate:N."""
    tenant_reasoning_policies: dict[str, str] = Field(default_factory=dict)
    """Tenant -> its own ``reasoning_policy``."""
    tier_redis_url: str | None = None
    """The Redis LMCache uses as L2; set to check a prompt's remote-tier residency before routing."""
    tier_coordinator_url: str | None = None
    """LMCache's coordinator (``lmcache coordinator``): when set, its key directory answers which tier and
    which instance holds a prompt (the Redis probe is the fallback while it is down), prefetches go through
    it, and a parked conversation's chain is pinned in L2. Its API is checked at start-up."""
    tier_rates_interval_s: float | None = Field(10.0, gt=0)
    """Scrape the workers' LMCache servers' throughput metrics this often and route with the learned
    ``cpu_load_gbps`` / ``remote_load_gbps`` (None: the configured constants)."""
    tier_chunk_tokens: int = Field(256, gt=0)
    """LMCache's chunk size."""
    tier_probe_timeout_s: float = Field(0.05, gt=0)
    """A residency probe of the remote tier slower than this counts as a miss."""
    tier_retry_s: float = Field(5.0, gt=0)
    """After a tier error, treat it as empty for this long before trying again."""
    cpu_tier_ttl_s: float = Field(300.0, gt=0)
    """How long a node's LMCache L1 is assumed to keep the chunks kvgate sent it."""
    waits: WaitParams = Field(default_factory=WaitParams)
    """Tool-wait prediction and the reserve/release rule."""
    prefill: PrefillParams = Field(default_factory=lambda: PrefillParams(enabled=False))
    """Background prefill of the canonical branch (off unless enabled)."""
    cache_control_max_retain_s: float = Field(3600.0, ge=0, le=86400)
    """The longest an answer's KV is reserved on its home worker because its request asked for it
    (Anthropic ``cache_control`` ttl: 5 min, or 1 h for ``"1h"``; OpenAI ``prompt_cache_retention: "24h"``),
    within the tenant's parked-KV budget; 0 ignores such asks (docs/tiering.md)."""
    prefill_priority: int | None = None
    """Request priority for background prefills, in vLLM's sense (lower first; needs --scheduling-policy priority);
    SGLang workers (higher first) get it negated. None sends none."""
    request_log: str | None = None
    """Write a content-free log of every request to this file, for ``kvgate tune`` (docs/operations.md)."""
    request_log_max_bytes: int = Field(64 << 20, ge=1 << 16)
    """Rotate the request log at this size."""
    request_log_backups: int = Field(3, ge=0, le=100)
    """Rotated request logs kept (``PATH.1`` is the newest)."""
    request_log_key: str | None = Field(None, pattern=r"^[0-9a-fA-F]{32,128}$")
    """Hex key the logged block hashes are keyed with; give every replica the same one for logs that
    replay together (default: random per process)."""
    grpc_port: int | None = Field(None, ge=0, le=65535)
    """kvgate's gRPC control API (``kvgate.v1``: Routing, Conversations, Policy, Fleet, with health and
    reflection) on ``host``:this port; None: off. 0 picks a free port (docs/grpc.md)."""
    epp_port: int | None = Field(None, ge=0, le=65535)
    """The Envoy ext_proc endpoint picker (Gateway API Inference Extension) on ``host``:this port; None:
    off (``kvgate epp`` defaults it to 9002; docs/epp.md)."""
    epp_body_mode: Literal["full_duplex_streamed", "buffered"] = "full_duplex_streamed"
    """How Envoy sends request bodies when its ext_proc filter does not say so itself (``protocol_config``):
    inference gateways configure FULL_DUPLEX_STREAMED; BUFFERED must match the filter's own setting."""
    epp_fallbacks: int = Field(1, ge=0, le=8)
    """Endpoints named after the picked one in ``x-gateway-destination-endpoint``, next best first, for
    Envoy's retries of a request the picked worker never had."""
    epp_auth: EppAuthSettings = Field(default_factory=EppAuthSettings)
    """Who may call the endpoint picker: a shared token in Envoy's ext_proc initial metadata and/or mutual
    TLS; only an authenticated caller is sent ``auth.worker_api_key`` (kvgate/epp/trust.py, docs/epp.md)."""

    @field_validator("conversation_headers")
    @classmethod
    def _lower(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError("at least one conversation header is needed")
        return [h.strip().lower() for h in v]

    @field_validator("reasoning_policy")
    @classmethod
    def _policy(cls, v: str) -> str:
        from kvgate.history.protocols import ReasoningPolicy

        return str(ReasoningPolicy.parse(v))

    @field_validator("tenant_reasoning_policies")
    @classmethod
    def _tenant_policies(cls, v: dict[str, str]) -> dict[str, str]:
        from kvgate.history.protocols import ReasoningPolicy

        return {t: str(ReasoningPolicy.parse(p)) for t, p in v.items()}

    @field_validator("protocols")
    @classmethod
    def _protocols(cls, v: dict[str, str]) -> dict[str, str]:
        from kvgate.history.protocols import get_protocol

        for p in v.values():
            get_protocol(p)
        return v

    @model_validator(mode="after")
    def _epp_callers(self) -> GatewaySettings:
        check_startup(self.epp_auth, self.auth.worker_api_key, self.epp_port)
        return self

    @model_validator(mode="after")
    def _processes_share(self) -> GatewaySettings:
        # N processes are one gateway only if what one learns the others read: conversations, timers,
        # policy, worker health and quotas live in the store; with memory each would keep its own, and a
        # conversation's next turn on a sibling would start cold.
        if self.processes == 1:
            return self
        if self.session_store != "redis":
            raise ValueError(f"processes: {self.processes} needs session_store: redis (the processes share "
                             "conversations, timers, policy and worker health through it); with the memory "
                             "store run one process (--workers 1) per pod")
        if self.admission.enabled and self.admission.store == "memory":
            raise ValueError(f"processes: {self.processes} needs admission.store redis or auto: with memory "
                             "each process would count its own quotas")
        if self.epp_port is not None:
            raise ValueError(f"processes: {self.processes} with the endpoint picker (epp_port) is not "
                             "supported: its ext_proc port is served by one process; run --workers 1")
        return self

    @model_validator(mode="after")
    def _unique_ids(self) -> GatewaySettings:
        ids = [w.id for w in self.workers]
        dup = {i for i in ids if ids.count(i) > 1}
        if dup:
            raise ValueError(f"duplicate worker ids: {sorted(dup)}")
        return self


def format_settings_error(exc: Exception, settings_cls: type[BaseSettings]) -> str:
    """One line for a value pydantic-settings could not even parse (``KVGATE_WORKERS='[{bad'``), naming
    the variable and the parser's complaint, instead of its traceback."""
    import re

    msg = str(exc)
    m = re.search(r'field "(\w+)" from source "(\w+)"', msg)
    cause = exc.__cause__ or exc.__context__
    why = f": {cause}" if cause is not None else ""
    if m is None:
        return f"invalid configuration: {msg}{why}"
    field, source = m.groups()
    if source.startswith("Env"):
        prefix = str(settings_cls.model_config.get("env_prefix", ""))
        where = f"{prefix}{field}".upper()
        return f"invalid configuration: {where} is not valid JSON{why}"
    return f"invalid configuration: {field} (from {source}){why}"


def format_validation_error(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "(settings)"
        # A misspelt key's value may be the secret it was meant to carry: not echoed.
        shown = "input" in err and not isinstance(err["input"], dict) and err["type"] != "extra_forbidden"
        lines.append(f"  {loc}: {err['msg']}" + (f" (got {err['input']!r})" if shown else ""))
    return "invalid configuration:\n" + "\n".join(lines)
