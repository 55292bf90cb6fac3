"""The four ``kvgate.v1`` services over one gateway process's state."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from typing import TYPE_CHECKING, Any, TypeAlias, TypeVar

import grpc

from kvgate.errors import BadRequest, Conflict, NotFound
from kvgate.gateway.policyedit import LEARNED_RATES
from kvgate.grpc import explain as explain_mod
from kvgate.grpc.auth import principal_of
from kvgate.grpc.convert import change_pb, conversation_pb, cost_changes, cost_pb, worker_pb
from kvgate.grpc.decisions import DecisionBus, TooManyWatchers
from kvgate.grpc.gen.kvgate.v1 import conversations_pb2 as cpb
from kvgate.grpc.gen.kvgate.v1 import conversations_pb2_grpc as cgrpc
from kvgate.grpc.gen.kvgate.v1 import fleet_pb2 as fpb
from kvgate.grpc.gen.kvgate.v1 import fleet_pb2_grpc as fgrpc
from kvgate.grpc.gen.kvgate.v1 import policy_pb2 as ppb
from kvgate.grpc.gen.kvgate.v1 import policy_pb2_grpc as pgrpc
from kvgate.grpc.gen.kvgate.v1 import routing_pb2 as rpb
from kvgate.grpc.gen.kvgate.v1 import routing_pb2_grpc as rgrpc
from kvgate.grpc.status import answer
from kvgate.router.types import ConversationId
from kvgate.session.conversation import Conversation

if TYPE_CHECKING:
    from kvgate.gateway.parts import Parts

Context: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"
T = TypeVar("T")


async def within_deadline(context: Context, aw: Awaitable[T]) -> T:
    """``aw``, given up with DEADLINE_EXCEEDED when the caller's deadline passes first (the work stops
    there: a tokenizer call or store read is cancelled rather than finished for nobody)."""
    left = context.time_remaining()
    try:
        async with asyncio.timeout(left if left is not None and left > 0 else None):
            return await aw
    except TimeoutError:
        await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "the call's deadline passed")


class RoutingService(rgrpc.RoutingServicer):
    def __init__(self, gw: Parts, bus: DecisionBus) -> None:
        self.gw = gw
        self.bus = bus

    async def Explain(self, request: rpb.ExplainRequest, context: Context) -> rpb.ExplainResponse:
        return await within_deadline(context, answer(context, explain_mod.explain(self.gw, request)))

    async def WatchDecisions(self, request: rpb.WatchDecisionsRequest, context: Context
                             ) -> AsyncIterator[rpb.DecisionEvent]:
        try:
            watch = self.bus.open(request)
        except TooManyWatchers as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        try:
            async for ev in watch.events():
                yield ev
        finally:
            self.bus.close(watch)


class ConversationsService(cgrpc.ConversationsServicer):
    def __init__(self, gw: Parts) -> None:
        self.gw = gw

    async def _get(self, cid: str) -> Conversation:
        if not cid:
            raise BadRequest("conversation_id is required", param="conversation_id", code="missing_field")
        conv = await self.gw.store.peek(ConversationId(cid))
        if conv is None:
            raise NotFound(f"conversation `{cid}` not found", param="conversation_id", code="conversation_not_found")
        return conv

    async def GetConversation(self, request: cpb.GetConversationRequest, context: Context) -> cpb.Conversation:
        conv = await within_deadline(context, answer(context, self._get(request.conversation_id)))
        return conversation_pb(conv, request.include_turns)

    async def _next_prefix(self, request: cpb.GetNextPrefixRequest) -> cpb.NextPrefix:
        conv = await self._get(request.conversation_id)
        if not conv.history:
            raise NotFound(f"conversation `{conv.id}` has no completed turn", param="conversation_id",
                           code="no_completed_turn")
        proto = self.gw.turns.protocol(conv.model, conv.tenant, request.reasoning_policy or None)
        tokens = self.gw.turns.next_turn_prefix(conv, proto)
        if tokens is None:
            raise Conflict(f"model `{conv.model}` has no local tokenizer", code="no_local_tokenizer")
        return cpb.NextPrefix(conversation_id=conv.id, model=conv.model, reasoning_policy=str(proto.policy),
                              tokens=len(tokens), token_ids=tokens if request.include_token_ids else [])

    async def GetNextPrefix(self, request: cpb.GetNextPrefixRequest, context: Context) -> cpb.NextPrefix:
        return await within_deadline(context, answer(context, self._next_prefix(request)))


class PolicyService(pgrpc.PolicyServicer):
    def __init__(self, gw: Parts) -> None:
        self.gw = gw

    def _state(self) -> ppb.PolicyState:
        return ppb.PolicyState(policy=self.gw.policy.name, cost=cost_pb(self.gw.cost.params),
                               version=self.gw.policy_sync.version)

    async def GetPolicy(self, request: ppb.GetPolicyRequest, context: Context) -> ppb.PolicyState:
        return self._state()

    async def UpdatePolicy(self, request: ppb.UpdatePolicyRequest, context: Context) -> ppb.UpdatePolicyResponse:
        changes: dict[str, float | int | str | None] = {**cost_changes(request.cost)}

        async def apply() -> ppb.UpdatePolicyResponse:
            for name in request.clear_pins:
                if name not in LEARNED_RATES or name in changes:
                    raise BadRequest(f"clear_pins: {name[:64]!r} is not a pinnable rate left unset in cost "
                                     f"(pinnable: {', '.join(LEARNED_RATES)})", param="clear_pins",
                                     code="invalid_value")
                changes[name] = None
            if not changes:
                raise BadRequest("no cost field set: name the fields to change", param="cost", code="empty_update")
            change = await self.gw.policy_sync.publish({"cost": changes}, principal_of(context, self.gw.auth).name,
                                                       "grpc", request.reason)
            return ppb.UpdatePolicyResponse(state=self._state(), change=change_pb(change))

        return await answer(context, apply())

    async def ListPolicyChanges(self, request: ppb.ListPolicyChangesRequest, context: Context
                                ) -> ppb.ListPolicyChangesResponse:
        if request.limit < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "limit must be >= 0")
        return ppb.ListPolicyChangesResponse(changes=[change_pb(c) for c in self.gw.policy_log.recent(request.limit)])


class FleetService(fgrpc.FleetServicer):
    def __init__(self, gw: Parts) -> None:
        self.gw = gw

    async def ListWorkers(self, request: fpb.ListWorkersRequest, context: Context) -> fpb.ListWorkersResponse:
        st = self.gw.prefix.events.stats
        workers = sorted((w for w in self.gw.pool.all() if not request.model or w.config.model == request.model),
                         key=lambda w: w.id)
        return fpb.ListWorkersResponse(workers=[worker_pb(self.gw, w) for w in workers], events_applied=st.applied,
                                       event_batches=st.batches, event_gaps=st.gaps,
                                       malformed_batches=st.malformed, resyncs=st.resyncs)
