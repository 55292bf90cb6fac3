"""What the fronts (gRPC control, the endpoint picker, the admin routes, the protocol doors) take of the
assembled gateway: its parts, not the assembly. ``kvgate.assembly.Gateway`` has them all; a front
annotates with ``Parts`` so that it depends on the pipeline below it, never on what assembles it."""

from __future__ import annotations

from typing import Protocol

from kvgate.clock import Clock
from kvgate.config import GatewaySettings
from kvgate.gateway.auth import Authenticator
from kvgate.gateway.inputlimits import PromptLimits
from kvgate.gateway.kvevents import KvEventSubscriber
from kvgate.gateway.policyedit import PolicyLog
from kvgate.gateway.policysync import PolicySync
from kvgate.gateway.prefix import PrefixKnowledge
from kvgate.gateway.prompts import PromptBuilder
from kvgate.gateway.proxy import Proxy
from kvgate.gateway.relay import Relay
from kvgate.gateway.route import Router
from kvgate.gateway.runtime import SessionRuntime
from kvgate.gateway.telemetry import GatewayMetrics
from kvgate.gateway.tierview import TierView
from kvgate.gateway.tracing import Tracing
from kvgate.gateway.turns import TurnService
from kvgate.gateway.workers import WorkerPool
from kvgate.kvstore.conversations import ConversationStore
from kvgate.router.cost import CostModel
from kvgate.router.policies import Policy


class Parts(Protocol):
    settings: GatewaySettings
    clock: Clock
    metrics: GatewayMetrics
    tracing: Tracing
    auth: Authenticator
    pool: WorkerPool
    policy: Policy
    cost: CostModel
    policy_log: PolicyLog
    policy_sync: PolicySync
    store: ConversationStore
    prefix: PrefixKnowledge
    subscriber: KvEventSubscriber
    prompts: PromptBuilder
    prompt_limits: PromptLimits
    turns: TurnService
    tiers: TierView
    runtime: SessionRuntime
    router: Router
    relay: Relay
    proxy: Proxy
    draining: bool
