"""Admission settings: ``GatewaySettings.admission`` (README's settings table, docs/admission.md)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

Priority = Literal["interactive", "batch"]


class TenantLimits(BaseModel):
    """One tenant's limits; None: unlimited. In ``tenants`` only the fields given replace the defaults."""

    model_config = ConfigDict(extra="forbid")

    max_concurrent: int | None = Field(None, ge=1)
    """Requests of the tenant admitted and not finished (queued or running), on all replicas together."""
    requests_per_minute: int | None = Field(None, ge=1)
    tokens_per_minute: int | None = Field(None, ge=1)
    """Prompt and completion tokens: the prompt (as kvgate counted it before routing) is checked and taken
    at admission, the completion taken when the response ends (into debt if need be, at most a minute's
    worth), as OpenAI counts both."""
    max_parked_kv_tokens: int | None = Field(None, ge=0)
    """KV the tenant's conversations may keep reserved on workers while their tools run (tokens, all
    replicas together); a tool wait that would go over it releases its KV instead (and prefetches it
    back when a remote tier holds it)."""
    prefill_tokens_per_minute: int | None = Field(None, ge=1)
    """Tokens of background prefill (the next turn's canonical prefix, computed while the user reads) the
    tenant may have issued per minute, each prefill counted by its gain (the prefix beyond what the worker
    caches: what the engine computes); over it a prefill is not issued."""
    weight: float = Field(1.0, gt=0, le=1000)
    """Share of the fleet's slots while requests queue for them, relative to the other tenants waiting."""


class AdmissionSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    enabled: bool = False
    """Off: no limits, no queue (behaviour before issue 11 part 3)."""
    defaults: TenantLimits = Field(default_factory=TenantLimits)
    tenants: dict[str, TenantLimits] = Field(default_factory=dict)
    """Tenant id -> overrides of ``defaults`` (the tenant of the credential; auth off: the tenant header,
    "" for requests without one)."""
    store: Literal["auto", "memory", "redis"] = "auto"
    """Where the rate buckets and concurrency leases live; auto: Redis when ``session_store`` is redis
    (shared by every replica), else this process's memory."""
    worker_slots: int | None = Field(None, ge=1)
    """Requests one worker runs at once (vLLM's ``--max-num-seqs``). None: learned from each engine's own
    counters (``admission/capacity.py``): until an engine has been seen with requests waiting, its cap is
    unknown and nothing waits for it. A model's requests beyond its workers' caps (less what other replicas
    run there) wait in this replica's fair queue."""
    slot_share_ttl_s: float = Field(3600.0, ge=0)
    """With ``session_store=redis``: the caps learned from the engines are shared by the replicas, so one
    that joins admits with the fleet's caps from its first request (``kvstore/capacity.py``); a reading
    older than this is not used (the engine behind the address may have changed). 0: each replica learns
    its own."""
    fair_share: bool = True
    """While other tenants are active, a tenant holds at most its weighted share of a model's slots
    (``admission/slots.py``); off: any free slot goes to whoever is next in fair order."""
    share_window_s: float = Field(10.0, ge=0, le=3600)
    """A tenant counts as active for this long after its last request arrived (an agent between two turns
    keeps its share)."""
    queue_size: int = Field(256, ge=0)
    """Requests waiting for a slot on this replica, all tenants together; more get 503."""
    max_queue_wait_s: float = Field(10.0, gt=0)
    """A request that waited this long for a slot gets 503."""
    lease_ttl_s: float = Field(30.0, ge=1)
    """A concurrency lease expires this long after its holder last renewed it (every third of it), so the
    slots of a replica that died return to its tenants."""
    priority_header: str = "x-kvgate-priority"
    """``interactive`` or ``batch``: interactive requests leave the queue first."""
    default_priority: Priority = "interactive"
    worker_priority: bool = False
    """Send the class to vLLM workers as the request's ``priority`` (effective only when the worker runs
    ``--scheduling-policy priority``; SGLang workers get it negated). Overrides a client's own."""
    interactive_priority: int = 0
    batch_priority: int = 10
    """vLLM's sense: lower runs first."""

    @field_validator("priority_header")
    @classmethod
    def _lower(cls, v: str) -> str:
        return v.strip().lower()

    def limits_for(self, tenant: str) -> TenantLimits:
        over = self.tenants.get(tenant)
        if over is None:
            return self.defaults
        return self.defaults.model_copy(update={k: getattr(over, k) for k in over.model_fields_set})
