"""The gRPC control API through a real gRPC channel against a running gateway with simulated workers:
answers that agree with the HTTP admin API and the proxy's own headers, bad requests and deadlines as
proper status codes, the decision stream, health, reflection, the role hook, and ``kvgate ctl``."""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any, Literal, get_origin

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvgate.cli import main
from kvgate.grpc import auth
from kvgate.grpc.gen.kvgate.v1 import conversations_pb2 as cpb
from kvgate.grpc.gen.kvgate.v1 import conversations_pb2_grpc as cgrpc
from kvgate.grpc.gen.kvgate.v1 import fleet_pb2 as fpb
from kvgate.grpc.gen.kvgate.v1 import fleet_pb2_grpc as fgrpc
from kvgate.grpc.gen.kvgate.v1 import policy_pb2 as ppb
from kvgate.grpc.gen.kvgate.v1 import policy_pb2_grpc as pgrpc
from kvgate.grpc.gen.kvgate.v1 import routing_pb2 as rpb
from kvgate.grpc.gen.kvgate.v1 import routing_pb2_grpc as rgrpc
from kvgate.router.cost import CostParams
from tests.conftest import MODEL, Cluster
from tests.helpers import eventually, metric

SYSTEM = "You are a coding agent working on a repository. " * 40


def body(conv_turns: list[dict[str, Any]], **kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "system", "content": SYSTEM}, *conv_turns], "max_tokens": 8, **kw}


async def chat(c: Cluster, conv: str, msgs: list[dict[str, Any]]) -> httpx.Response:
    async with httpx.AsyncClient(timeout=30) as h:
        r = await h.post(c.url + "/v1/chat/completions", json=body(msgs), headers={"x-conversation-id": conv})
    assert r.status_code == 200, r.text
    return r


async def cluster(make_cluster: Any, **kw: Any) -> tuple[Cluster, grpc.aio.Channel]:
    c: Cluster = await make_cluster(2, events=True, grpc_port=0, **kw)
    port = c.gateway_handle.server.config.app.state.grpc.control_port  # type: ignore[union-attr]
    return c, grpc.aio.insecure_channel(f"127.0.0.1:{port}")


def explain_req(msgs: list[dict[str, Any]], conv: str, **kw: Any) -> rpb.ExplainRequest:
    return rpb.ExplainRequest(body_json=json.dumps(body(msgs)), endpoint=rpb.ENDPOINT_CHAT,
                              headers={"x-conversation-id": conv}, **kw)


async def rpc_error(aw: Any) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await aw
    return info.value


def trailing(err: grpc.aio.AioRpcError) -> dict[str, str]:
    return {k: str(v) for k, v in err.trailing_metadata() or ()}


async def test_explain_names_the_worker_the_proxy_then_uses_and_changes_nothing(make_cluster: Any) -> None:
    c, ch = await cluster(make_cluster)
    routing = rgrpc.RoutingStub(ch)
    first = [{"role": "user", "content": "Find the bug in the session cache."}]
    r1 = await chat(c, "conv-x", first)
    msgs = [*first, r1.json()["choices"][0]["message"], {"role": "user", "content": "Now fix it."}]
    decisions_before = await metric(c, "kvgate_route_decisions_total")
    ans = await routing.Explain(explain_req(msgs, "conv-x"), timeout=10)
    home = r1.headers["x-kvgate-worker"]
    assert ans.decision.worker == home and ans.conversation.known and ans.conversation.home_worker == home
    assert ans.conversation.id == "conv-x" and ans.conversation.source == "header:x-conversation-id"
    assert ans.decision.endpoint == home and ans.decision.policy == "cost_model"
    assert ans.decision.expected_cached_tokens > 0 and ans.decision.tier == "gpu"
    cands = {x.worker: x for x in ans.candidates}
    assert set(cands) == {w.id for w in c.gateway.pool.all()}
    assert cands[home].expected.gpu == ans.decision.expected_cached_tokens
    other = next(w for w in cands if w != home)
    assert cands[other].expected.gpu < cands[home].expected.gpu
    # Every scored candidate's score is its components, and the chosen one wins with the move prior.
    for x in cands.values():
        assert x.HasField("score") and not x.left_out
        assert math.isclose(x.score, x.ttft_ms + x.delay_to_others_ms + x.reservation_ms + x.backlog_ms)
    assert min(cands.values(), key=lambda x: x.score + x.move_ms).worker == home
    assert ans.prompt.tokens > 0 and ans.prompt.source == "local" and ans.history.reasoning_policy == "keep"
    # Nothing was sent, counted or written.
    assert await metric(c, "kvgate_route_decisions_total") == decisions_before
    assert all(w.in_flight == 0 for w in c.gateway.pool.all())
    conv = await c.gateway.store.peek("conv-x")  # type: ignore[arg-type]
    assert conv is not None and conv.turn_count == 1
    # ... and the proxy then sends the request exactly there.
    r2 = await chat(c, "conv-x", msgs)
    assert r2.headers["x-kvgate-worker"] == home
    assert int(r2.headers["x-kvgate-expected-cached-tokens"]) == ans.decision.expected_cached_tokens
    # Left out: excluded workers, and those outside an endpoint subset.
    ex = await routing.Explain(explain_req(msgs, "conv-x", exclude_workers=[home]), timeout=10)
    assert ex.decision.worker == other
    assert {x.worker: x.left_out for x in ex.candidates}[home] == "excluded"
    sub = await routing.Explain(explain_req(msgs, "conv-x", endpoint_subset=[other]), timeout=10)
    assert sub.decision.worker == other and {x.worker: x.left_out for x in sub.candidates}[home] == "not_in_subset"
    await ch.close()


@pytest.mark.parametrize(("request_kw", "code", "openai_code"), [
    ({"body_json": "{not json"}, grpc.StatusCode.INVALID_ARGUMENT, "invalid_json"),
    ({"body_json": "[1]"}, grpc.StatusCode.INVALID_ARGUMENT, "invalid_json"),
    ({"body_json": json.dumps({"model": MODEL})}, grpc.StatusCode.INVALID_ARGUMENT, None),
    ({"body_json": json.dumps({"model": "no-such", "messages": [{"role": "user", "content": "x"}]})},
     grpc.StatusCode.NOT_FOUND, "model_not_found"),
    ({"body_json": json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                               "previous_response_id": "resp-nope"})}, grpc.StatusCode.NOT_FOUND, "response_not_found"),
    ({"body_json": json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x" * 20000}]})},
     grpc.StatusCode.RESOURCE_EXHAUSTED, "request_too_large"),
])
async def test_explain_answers_bad_requests_with_their_status(make_cluster: Any, request_kw: dict[str, str],
                                                              code: grpc.StatusCode, openai_code: str | None) -> None:
    _, ch = await cluster(make_cluster, max_body_bytes=16384)
    err = await rpc_error(rgrpc.RoutingStub(ch).Explain(rpb.ExplainRequest(**request_kw), timeout=10))
    assert err.code() == code, err.details()
    if openai_code:
        assert trailing(err)["kvgate-error-code"] == openai_code
    await ch.close()


async def test_deadlines_end_calls_and_the_server_lets_go(make_cluster: Any) -> None:
    # A context large enough that the long prompt is rendered and tokenized (tens of ms), not refused by its
    # character count in well under the 1 ms deadline (which made this race the deadline and lose now and then).
    c, ch = await cluster(make_cluster, hostile={"max_prompt_tokens": 1_000_000})
    routing = rgrpc.RoutingStub(ch)
    big = [{"role": "user", "content": "a long prompt " * 20000}]
    err = await rpc_error(routing.Explain(explain_req(big, "slow"), timeout=0.001))
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    # A decision stream runs until its deadline; the server then drops the watcher.
    bus = c.gateway_handle.server.config.app.state.grpc.bus  # type: ignore[union-attr]
    call = routing.WatchDecisions(rpb.WatchDecisionsRequest(), timeout=0.5)
    got: list[rpb.DecisionEvent] = []

    async def read() -> None:
        async for ev in call:
            got.append(ev)

    reader = asyncio.ensure_future(read())
    await eventually(lambda: bus.watchers > 0)
    await chat(c, "deadline-conv", [{"role": "user", "content": "hello"}])
    err = await rpc_error(reader)
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED and len(got) == 1
    for _ in range(100):
        if bus.watchers == 0:
            break
        await asyncio.sleep(0.01)
    assert bus.watchers == 0
    await ch.close()


async def test_decision_stream_shows_each_real_decision(make_cluster: Any) -> None:
    c, ch = await cluster(make_cluster)
    call = rgrpc.RoutingStub(ch).WatchDecisions(rpb.WatchDecisionsRequest(conversation_id="watched",
                                                                           include_scores=True))
    bus = c.gateway_handle.server.config.app.state.grpc.bus  # type: ignore[union-attr]
    await eventually(lambda: bus.watchers > 0)
    await chat(c, "not-watched", [{"role": "user", "content": "other"}])
    r = await chat(c, "watched", [{"role": "user", "content": "mine"}])
    ev = await call.read()
    assert isinstance(ev, rpb.DecisionEvent)
    assert (ev.conversation_id, ev.front, ev.attempt, ev.model) == ("watched", "proxy", 1, MODEL)
    assert ev.decision.worker == r.headers["x-kvgate-worker"]
    assert f"cost_model:{ev.decision.reason}" == r.headers["x-kvgate-route-reason"]
    assert set(ev.scores) == {w.id for w in c.gateway.pool.all()} and ev.prompt_tokens > 0
    call.cancel()
    await ch.close()


async def test_decision_watchers_are_bounded_and_count_what_they_miss(make_cluster: Any) -> None:
    from kvgate.grpc.decisions import DecisionBus, TooManyWatchers

    c, ch = await cluster(make_cluster)
    gw = c.gateway
    bus = DecisionBus(lambda d: rpb.Decision(worker=d.worker), queue=2, max_watchers=1)
    gw.router.listeners.append(bus)
    w = bus.open(rpb.WatchDecisionsRequest())
    with pytest.raises(TooManyWatchers):
        bus.open(rpb.WatchDecisionsRequest())
    for i in range(5):
        await chat(c, f"many-{i}", [{"role": "user", "content": f"q{i}"}])
    events = w.events()
    first, second = await events.__anext__(), await events.__anext__()
    assert first.dropped == 3 and second.dropped == 0 and second.conversation_id == "many-4"
    await ch.close()


async def test_conversations_match_the_http_admin_api(make_cluster: Any) -> None:
    c, ch = await cluster(make_cluster)
    convs = cgrpc.ConversationsStub(ch)
    first = [{"role": "user", "content": "What does the cache key contain?"}]
    r1 = await chat(c, "conv-c", first)
    await chat(c, "conv-c", [*first, r1.json()["choices"][0]["message"], {"role": "user", "content": "And then?"}])
    got = await convs.GetConversation(cpb.GetConversationRequest(conversation_id="conv-c", include_turns=True),
                                      timeout=5)
    async with httpx.AsyncClient() as h:
        http = (await h.get(c.url + "/admin/conversations/conv-c")).json()
        nxt = (await h.get(c.url + "/admin/conversations/conv-c/next-prefix")).json()
    assert got.turn_count == http["turn_count"] == 2 and got.home_worker == http["home_worker"]
    assert got.lifecycle.state == http["lifecycle"]["state"] and got.chain_tokens == http["chain_tokens"]
    assert [(t.worker, t.cached_tokens, t.prompt_tokens) for t in got.turns] == \
        [(t["worker"], t["cached_tokens"], t["prompt_tokens"]) for t in http["turns"]]
    assert got.turns[1].cached_tokens > 0
    np = await convs.GetNextPrefix(cpb.GetNextPrefixRequest(conversation_id="conv-c", include_token_ids=True),
                                   timeout=5)
    assert np.tokens == nxt["tokens"] and list(np.token_ids) == nxt["token_ids"]
    err = await rpc_error(convs.GetConversation(cpb.GetConversationRequest(conversation_id="nope"), timeout=5))
    assert err.code() == grpc.StatusCode.NOT_FOUND
    err = await rpc_error(convs.GetConversation(cpb.GetConversationRequest(), timeout=5))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    err = await rpc_error(convs.GetNextPrefix(cpb.GetNextPrefixRequest(conversation_id="conv-c",
                                                                       reasoning_policy="sometimes"), timeout=5))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    await ch.close()


def test_cost_params_message_mirrors_the_cost_model() -> None:
    fields = ppb.CostParams.DESCRIPTOR.fields_by_name
    assert list(fields) == list(CostParams.model_fields)
    for name, f in CostParams.model_fields.items():
        want = (fields[name].CPPTYPE_INT64 if f.annotation is int else fields[name].CPPTYPE_STRING
                if get_origin(f.annotation) is Literal else fields[name].CPPTYPE_DOUBLE)
        assert fields[name].cpp_type == want, name


async def test_policy_updates_are_validated_like_http_and_logged_with_who(make_cluster: Any) -> None:
    c, ch = await cluster(make_cluster)
    pol = pgrpc.PolicyStub(ch)
    async with httpx.AsyncClient() as h:
        http = (await h.get(c.url + "/admin/policy")).json()
        state = await pol.GetPolicy(ppb.GetPolicyRequest(), timeout=5)
        assert state.policy == http["policy"]
        assert {f.name: v for f, v in state.cost.ListFields()} == pytest.approx(http["cost"])
        err = await rpc_error(pol.UpdatePolicy(ppb.UpdatePolicyRequest(
            cost=ppb.CostParams(token_budget=-5, affinity_bonus_ms=9)), timeout=5))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert trailing(err)["kvgate-error-param"] == "cost.token_budget"
        err = await rpc_error(pol.UpdatePolicy(ppb.UpdatePolicyRequest(cost=ppb.CostParams(p0_ms=math.inf)), timeout=5))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        err = await rpc_error(pol.UpdatePolicy(ppb.UpdatePolicyRequest(), timeout=5))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (await h.get(c.url + "/admin/policy")).json() == http  # nothing half-applied
        await h.patch(c.url + "/admin/policy", json={"cost": {"load_epsilon": 0.5}})
        ok = await pol.UpdatePolicy(ppb.UpdatePolicyRequest(cost=ppb.CostParams(affinity_bonus_ms=9), reason="tie"),
                                    timeout=5)
        assert ok.state.cost.affinity_bonus_ms == 9 and ok.state.cost.load_epsilon == 0.5
        assert (await h.get(c.url + "/admin/policy")).json()["cost"]["affinity_bonus_ms"] == 9
    log = await pol.ListPolicyChanges(ppb.ListPolicyChangesRequest(), timeout=5)
    assert [(x.via, x.reason, [(f.field, f.new_value) for f in x.changes]) for x in log.changes] == [
        ("http", "", [("load_epsilon", 0.5)]), ("grpc", "tie", [("affinity_bonus_ms", 9.0)])]
    assert all(x.who.startswith("anonymous@") for x in log.changes)
    await ch.close()


async def test_a_rate_pinned_over_grpc_is_cleared_over_grpc(make_cluster: Any) -> None:
    c, ch = await cluster(make_cluster)
    pol = pgrpc.PolicyStub(ch)
    async with httpx.AsyncClient() as h:
        await pol.UpdatePolicy(ppb.UpdatePolicyRequest(cost=ppb.CostParams(remote_load_gbps=9)), timeout=5)
        got = (await h.get(c.url + "/admin/policy")).json()
        assert got["rate_sources"]["remote_load_gbps"] == "operator" and got["cost"]["remote_load_gbps"] == 9
        for bad in (["decode_ms"], ["remote_load_gbps", "x" * 10_000]):
            err = await rpc_error(pol.UpdatePolicy(ppb.UpdatePolicyRequest(clear_pins=bad), timeout=5))
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert trailing(err)["kvgate-error-param"] == "clear_pins"
        err = await rpc_error(pol.UpdatePolicy(ppb.UpdatePolicyRequest(
            cost=ppb.CostParams(remote_load_gbps=3), clear_pins=["remote_load_gbps"]), timeout=5))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT  # pin and clear the same rate: which one?
        assert (await h.get(c.url + "/admin/policy")).json() == got  # nothing half-applied
        ok = await pol.UpdatePolicy(ppb.UpdatePolicyRequest(clear_pins=["remote_load_gbps"]), timeout=5)
        assert ok.state.cost.remote_load_gbps != 9
        assert (await h.get(c.url + "/admin/policy")).json()["rate_sources"]["remote_load_gbps"] != "operator"
    await ch.close()


async def test_fleet_lists_workers_with_load_index_and_event_streams(make_cluster: Any) -> None:
    c, ch = await cluster(make_cluster)
    r = await chat(c, "conv-f", [{"role": "user", "content": "index me " * 50}])
    fleet = fgrpc.FleetStub(ch)
    ans = await fleet.ListWorkers(fpb.ListWorkersRequest(), timeout=5)
    assert [w.id for w in ans.workers] == sorted(w.id for w in c.gateway.pool.all())
    for w in ans.workers:
        assert w.healthy and w.health == "up" and w.endpoint == w.id and w.model == MODEL
        assert w.events.subscribed and w.events.endpoint.startswith("tcp://") and not w.events.stale
        assert w.block_size == c.gateway.pool.get(w.id).config.block_size
    served = next(w for w in ans.workers if w.id == r.headers["x-kvgate-worker"])
    assert served.index.gpu_blocks > 0 and ans.events_applied > 0
    assert (await fleet.ListWorkers(fpb.ListWorkersRequest(model="other"), timeout=5)).workers == []
    await ch.close()


async def test_health_and_reflection_name_every_service(make_cluster: Any) -> None:
    _, ch = await cluster(make_cluster)
    hs = health_pb2_grpc.HealthStub(ch)
    for name in ("", "kvgate.v1.Routing", "kvgate.v1.Conversations", "kvgate.v1.Policy", "kvgate.v1.Fleet"):
        assert (await hs.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)).status == \
            health_pb2.HealthCheckResponse.SERVING
    refl = reflection_pb2_grpc.ServerReflectionStub(ch)
    call = refl.ServerReflectionInfo()
    await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
    resp = await call.read()
    names = {s.name for s in resp.list_services_response.service}
    assert {"kvgate.v1.Routing", "kvgate.v1.Conversations", "kvgate.v1.Policy", "kvgate.v1.Fleet"} <= names
    await call.write(reflection_pb2.ServerReflectionRequest(file_containing_symbol="kvgate.v1.Routing"))
    resp = await call.read()
    assert resp.file_descriptor_response.file_descriptor_proto
    await call.done_writing()
    await ch.close()


async def test_the_auth_hook_refuses_before_the_service_runs(make_cluster: Any, monkeypatch: pytest.MonkeyPatch
                                                             ) -> None:
    c, ch = await cluster(make_cluster)
    pol = pgrpc.PolicyStub(ch)
    before = c.gateway.cost.params
    # A principal without the operate role may read but not change the policy.
    monkeypatch.setattr(auth, "authenticate", lambda md, *_: auth.Principal("viewer", frozenset({auth.READ})))
    await pol.GetPolicy(ppb.GetPolicyRequest(), timeout=5)
    err = await rpc_error(pol.UpdatePolicy(ppb.UpdatePolicyRequest(cost=ppb.CostParams(p0_ms=1)), timeout=5))
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED and c.gateway.cost.params is before
    # No credentials: refused; health stays open for probes.
    monkeypatch.setattr(auth, "authenticate", lambda md, *_: None)
    err = await rpc_error(fgrpc.FleetStub(ch).ListWorkers(fpb.ListWorkersRequest(), timeout=5))
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED
    assert (await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)).status == \
        health_pb2.HealthCheckResponse.SERVING
    # A method nobody gave a role is refused, not allowed by default.
    monkeypatch.setattr(auth, "authenticate", lambda md, *_: auth.Principal("root", frozenset({auth.READ,
                                                                                                  auth.OPERATE})))
    monkeypatch.delitem(auth.ROLES, "/kvgate.v1.Fleet/ListWorkers")
    err = await rpc_error(fgrpc.FleetStub(ch).ListWorkers(fpb.ListWorkersRequest(), timeout=5))
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED
    await ch.close()


async def test_kvgate_ctl(make_cluster: Any, capsys: pytest.CaptureFixture[str], tmp_path: Any) -> None:
    c, ch = await cluster(make_cluster)
    target = f"127.0.0.1:{c.gateway_handle.server.config.app.state.grpc.control_port}"  # type: ignore[union-attr]

    async def ctl(*args: str) -> int:
        try:
            await asyncio.to_thread(main, ["ctl", "--target", target, *args])
        except SystemExit as exc:
            return int(exc.code or 0)
        return 0

    assert await ctl("workers") == 0
    assert {w["id"] for w in json.loads(capsys.readouterr().out)["workers"]} == {w.id for w in c.gateway.pool.all()}
    f = tmp_path / "req.json"
    f.write_text(json.dumps(body([{"role": "user", "content": "hi"}])))
    assert await ctl("explain", str(f), "--header", "x-conversation-id: ctl-conv") == 0
    out = json.loads(capsys.readouterr().out)
    assert out["conversation"]["id"] == "ctl-conv" and out["decision"]["worker"]
    assert await ctl("policy", "set", "affinity_bonus_ms=3.5", "--reason", "ctl") == 0
    assert json.loads(capsys.readouterr().out)["state"]["cost"]["affinity_bonus_ms"] == 3.5
    assert await ctl("policy", "set", "token_budget=-1") == 1
    assert "INVALID_ARGUMENT" in capsys.readouterr().err
    assert await ctl("conversation", "missing") == 1
    err = capsys.readouterr().err
    assert "NOT_FOUND" in err and "code=conversation_not_found" in err
    await ch.close()


async def test_explain_a_completion(make_cluster: Any) -> None:
    c, ch = await cluster(make_cluster)
    req = rpb.ExplainRequest(body_json=json.dumps({"model": MODEL, "prompt": "def add(a, b):", "max_tokens": 4}),
                             endpoint=rpb.ENDPOINT_COMPLETIONS, headers={"x-conversation-id": "comp"})
    ans = await rgrpc.RoutingStub(ch).Explain(req, timeout=10)
    assert ans.decision.worker in {w.id for w in c.gateway.pool.all()} and not ans.HasField("history")
    assert ans.prompt.tokens > 0 and not ans.conversation.known
    await ch.close()
