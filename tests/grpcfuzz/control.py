"""The gRPC control API in tests/test_grpc_fuzz.py: hostile requests for every method (``message_for``),
one sent and its answer checked (``control``), and decision watchers opened and checked (``open_watch``,
``close_watch``)."""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2
from hypothesis import strategies as st

from kvgate.gateway.policyedit import MAX_ABS, MAX_INT
from kvgate.grpc.gen.kvgate.v1 import conversations_pb2 as cpb
from kvgate.grpc.gen.kvgate.v1 import fleet_pb2 as fpb
from kvgate.grpc.gen.kvgate.v1 import policy_pb2 as ppb
from kvgate.grpc.gen.kvgate.v1 import routing_pb2 as rpb
from tests.conftest import MODEL
from tests.grpcfuzz.fleet import CALL_TIMEOUT_S, GRPC_LIMIT, OPERATOR_KEY, TENANT, Fleet, Side
from tests.grpcfuzz.wire import Answer, is_utf8, ld, parses, unary
from tests.httpfuzz.strategies import CHAT, COMPLETION, CONV_IDS, HUGE_TEXT, TEXT, encoded, mutated

# --- the control API: requests --------------------------------------------------------------------------

PTEXT = TEXT | HUGE_TEXT
"""Hostile text a proto string can hold (no lone surrogates: those go on the wire as invalid UTF-8)."""
KNOWN_IDS = st.sampled_from(["seed-1", "seed-2", f"{TENANT}/seed-1", f"{TENANT}/seed-2"])
"""Conversations with a completed turn (``seed``; the secured gateway scopes them by tenant)."""
IDS = st.integers(0, 2).flatmap(lambda i: KNOWN_IDS if i else st.sampled_from(
    ["other/seed-1", "seed-1/", "SEED-1", "seed-1\x00", f"{TENANT}/", "/seed-1", "nope"])
    | CONV_IDS.filter(lambda s: is_utf8(s.encode("utf-8", "surrogatepass"))))
WORKERS = st.sampled_from(["$w0", "$w1", "$e0", "$e1", " $e0 ", "$e0,$e1", "", "10.9.9.9:8000", "[::1]:1",
                           "127.0.0.1:0"]) | PTEXT
HEADER_NAMES = ["x-conversation-id", "x-session-id", "x-tenant-id", "x-kvgate-reasoning-policy", "priority",
                "x-priority", "authorization", "x-api-key", "x-gateway-destination-endpoint", "X-Conversation-Id",
                "X-TENANT-ID", "traceparent", "content-type", ":path", ""]
HEADER_VALUES = st.sampled_from(["seed-1", "wf-0", TENANT, "other", "gf/seed-1", "keep", "drop", "truncate:2",
                                 "truncate:²", "truncate:" + "9" * 5000, "high", "-1", f"Bearer {OPERATOR_KEY}",
                                 "10.9.9.9:8000"]) | PTEXT


def many(strategy: st.SearchStrategy[str], most: int) -> st.SearchStrategy[list[str]]:
    """Mostly a few, now and then thousands (repeated fields; the thousands of short values: thousands of
    huge ones are only a message over the size limit, which a few huge ones already are)."""
    return st.integers(0, 9).flatmap(lambda i: st.lists(strategy, max_size=4) if i else st.builds(
        lambda x, n: [x[:64]] * n, strategy, st.integers(100, most)))


ENDPOINT_ENUM = st.sampled_from([0, 1, 2]) | st.integers(-(2**31), 2**31 - 1)
WELL_TEXT = st.sampled_from(["hi", "Where is the bug?", "é🙂", "<|im_start|>", "\u202e", "a\x00b", " "]) \
    | st.text(min_size=1, max_size=60)
WELL_MSG = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]), "content": WELL_TEXT})
WELL_CHAT = st.fixed_dictionaries(
    {"model": st.just(MODEL), "messages": st.lists(WELL_MSG, max_size=3).map(
        lambda ms: [*ms, {"role": "user", "content": "and now?"}])},
    optional={"max_tokens": st.integers(1, 8), "stream": st.booleans(), "temperature": st.floats(0, 2),
              "reasoning_policy": st.sampled_from(["keep", "drop", "truncate:4"]), "user": WELL_TEXT})
WELL_COMPLETION = st.fixed_dictionaries(
    {"model": st.just(MODEL), "prompt": WELL_TEXT | st.lists(st.integers(0, 200), min_size=1, max_size=20)},
    optional={"max_tokens": st.integers(1, 8), "stream": st.booleans()})


@st.composite
def explain_request(draw: st.DrawFn) -> bytes:
    completions = draw(st.booleans())
    kind = draw(st.integers(0, 9))
    if kind < 2:  # valid bodies: the deeper checks (history, routing) are reached
        body = json.dumps(draw(WELL_COMPLETION if completions else WELL_CHAT)).encode()
    else:
        body = draw(encoded(draw(mutated(COMPLETION if completions else CHAT))))
    req = rpb.ExplainRequest(
        endpoint=draw(st.just(int(rpb.ENDPOINT_COMPLETIONS if completions else rpb.ENDPOINT_CHAT))
                      | ENDPOINT_ENUM),  # type: ignore[arg-type]  # an open enum: any int32 goes
        headers=draw(st.dictionaries(st.sampled_from(HEADER_NAMES) | PTEXT, HEADER_VALUES, max_size=5)
                     | st.builds(lambda n: {f"x-junk-{i}": "v" for i in range(n)}, st.integers(100, 5000))),
        exclude_workers=draw(many(WORKERS, 20_000)), endpoint_subset=draw(many(WORKERS, 20_000)))
    try:
        req.body_json = body.decode("utf-8")
        data = req.SerializeToString()
    except UnicodeDecodeError:  # invalid UTF-8 (encoded surrogates, garbage): only the raw wire carries it
        data = req.SerializeToString() + ld(1, body)
    return data


def _cost_value(f: Any) -> st.SearchStrategy[Any]:
    """Mostly what the field takes, so a fair share of updates is accepted and what they set can be
    checked; else NaN, ±Inf, huge, subnormal, negative, out-of-range int64."""
    if f.cpp_type == f.CPPTYPE_STRING:  # a mode (tier_loads): one it knows, or any text
        return st.sampled_from(["sync", "async"]) | st.sampled_from(["", "SYNC", "a" * 5000, "\x00"]) | PTEXT
    if f.cpp_type == f.CPPTYPE_INT64:
        valid: st.SearchStrategy[Any] = st.integers(1, 10**6)
        hostile: st.SearchStrategy[Any] = st.integers(-(2**63), 2**63 - 1) | st.sampled_from(
            [0, -1, MAX_INT, MAX_INT + 1, -MAX_INT - 1, 2**63 - 1, -(2**63), 10**15])
    else:
        valid = st.floats(0, 50) | st.sampled_from([0.0, -0.0, 5e-324, 1e-300, MAX_ABS])
        hostile = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from(
            [math.nan, -math.nan, math.inf, -math.inf, 1e308, -1e308, math.nextafter(MAX_ABS, math.inf), -MAX_ABS - 1,
             1e12, -1.0])
    return st.integers(0, 9).flatmap(lambda i: valid if i < 7 else hostile)


COST_FIELDS = list(ppb.CostParams.DESCRIPTOR.fields)
COST = st.lists(st.sampled_from(COST_FIELDS), unique_by=lambda f: f.name, max_size=4).flatmap(
    lambda fs: st.fixed_dictionaries({f.name: _cost_value(f) for f in fs}))
"""0-4 fields: none set is refused (empty_update), one to four are what an operator changes at once."""


@st.composite
def update_policy_request(draw: st.DrawFn) -> bytes:
    cost = draw(COST)
    req = ppb.UpdatePolicyRequest(cost=ppb.CostParams(**cost), reason=draw(PTEXT | st.just("r" * 5000)))
    return req.SerializeToString()


REQUESTS: dict[str, tuple[type[Message], type[Message]]] = {
    "/kvgate.v1.Routing/Explain": (rpb.ExplainRequest, rpb.ExplainResponse),
    "/kvgate.v1.Conversations/GetConversation": (cpb.GetConversationRequest, cpb.Conversation),
    "/kvgate.v1.Conversations/GetNextPrefix": (cpb.GetNextPrefixRequest, cpb.NextPrefix),
    "/kvgate.v1.Policy/GetPolicy": (ppb.GetPolicyRequest, ppb.PolicyState),
    "/kvgate.v1.Policy/UpdatePolicy": (ppb.UpdatePolicyRequest, ppb.UpdatePolicyResponse),
    "/kvgate.v1.Policy/ListPolicyChanges": (ppb.ListPolicyChangesRequest, ppb.ListPolicyChangesResponse),
    "/kvgate.v1.Fleet/ListWorkers": (fpb.ListWorkersRequest, fpb.ListWorkersResponse),
    "/grpc.health.v1.Health/Check": (health_pb2.HealthCheckRequest, health_pb2.HealthCheckResponse),
}
UPDATE = "/kvgate.v1.Policy/UpdatePolicy"
OPEN_METHODS = ("/grpc.health.v1.Health/",)


def message_for(method: str) -> st.SearchStrategy[bytes]:
    if method.endswith("/Explain"):
        return explain_request()
    if method.endswith("/UpdatePolicy"):
        return update_policy_request()
    if method.endswith("/GetConversation"):
        return st.builds(lambda i, t: cpb.GetConversationRequest(conversation_id=i, include_turns=t)
                         .SerializeToString(), IDS, st.booleans())
    if method.endswith("/GetNextPrefix"):
        return st.builds(lambda i, p, t: cpb.GetNextPrefixRequest(conversation_id=i, reasoning_policy=p,
                                                                  include_token_ids=t).SerializeToString(),
                         IDS, st.sampled_from(["", "keep", "drop", "truncate:1", "truncate:0", "truncate:-1",
                                               "truncate:²", "truncate:" + "9" * 5000, "TRUNCATE:3", " keep "])
                         | PTEXT, st.booleans())
    if method.endswith("/ListPolicyChanges"):
        return st.builds(lambda n: ppb.ListPolicyChangesRequest(limit=n).SerializeToString(),
                         st.integers(-(2**31), 2**31 - 1) | st.sampled_from([0, 1, -1, 256, 257]))
    if method.endswith("/ListWorkers"):
        return st.builds(lambda m: fpb.ListWorkersRequest(model=m).SerializeToString(),
                         st.sampled_from([MODEL, "", "other"]) | PTEXT)
    if method.endswith("/Check"):
        return st.builds(lambda s: health_pb2.HealthCheckRequest(service=s).SerializeToString(),
                         st.sampled_from(["", "kvgate.v1.Routing", "kvgate.v1.Policy", "nope"]) | PTEXT)
    return st.just(b"")


def resolve_text(s: str, side: Side) -> str:
    if "$" not in s:
        return s
    for i, w in enumerate(side.workers):
        s = s.replace(f"$w{i}", w)
    for i, e in enumerate(side.endpoints):
        s = s.replace(f"$e{i}", e)
    return s


def resolve_msg(data: bytes, msg: type[Message], side: Side) -> bytes:
    """The request with placeholder worker ids and endpoints as the side's own (only for one that
    parses; bent bytes are sent as they are)."""
    if b"$" not in data:
        return data
    m = parses(data, msg)
    if not isinstance(m, rpb.ExplainRequest) or m.SerializeToString() != data:
        return data
    ex = [resolve_text(x, side) for x in m.exclude_workers]
    sub = [resolve_text(x, side) for x in m.endpoint_subset]
    del m.exclude_workers[:]
    del m.endpoint_subset[:]
    m.exclude_workers.extend(ex)
    m.endpoint_subset.extend(sub)
    return m.SerializeToString()


# --- the control API: sending and checking --------------------------------------------------------------

BAD_CODES = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DATA_LOSS,
             grpc.StatusCode.DEADLINE_EXCEEDED}
REFUSED = {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED}
METADATA_SOFT = 8192 - 1024
"""Request metadata past gRPC's soft limit (8 KiB with the call's own headers) may be refused by the
transport, RESOURCE_EXHAUSTED, before kvgate sees it."""


async def get_policy(side: Side) -> bytes:
    out = await unary(side.control, "/kvgate.v1.Policy/GetPolicy", b"", side.operator_md())
    assert out.code == grpc.StatusCode.OK and out.data is not None, out
    return out.data


def cost_bounded(cost: ppb.CostParams) -> list[tuple[str, float | str]]:
    """Parameters out of their bounds: a number not finite or too big, a mode not one the model knows."""
    modes = {"tier_loads": ("sync", "async")}
    return [(f.name, v) for f, v in cost.ListFields()
            if (v not in modes.get(f.name, ()) if isinstance(v, str)
                else not (math.isfinite(v) and (abs(v) <= MAX_INT if isinstance(v, int) else abs(v) <= MAX_ABS)))]


async def control(fleet: Fleet, side: Side, method: str, data: bytes, md: tuple[tuple[str, str | bytes], ...],
                  expect: str | None) -> Answer:
    tally = fleet.tally
    tally.requests["control"] += 1
    req_type, resp_type = REQUESTS.get(method, (ppb.GetPolicyRequest, ppb.PolicyState))
    data = resolve_msg(data, req_type, side)
    policy_before = log_before = None
    params_before = None
    if method == UPDATE:
        policy_before = await get_policy(side)
        params_before = side.gw.cost.params
        log_before = side.gw.policy_log.recent()
    t0 = time.monotonic()
    out = await unary(side.control, method, data, md)
    tally.seconds.append((time.monotonic() - t0, f"{side.name} {method} {len(data)} bytes {out.code.name}"))
    tally.codes[f"{method.rsplit('/', 1)[-1]} {out.code.name} {out.trailing.get('kvgate-error-code', '')}".strip()] += 1
    if len(fleet.replay_control) < 100 and method != UPDATE:
        fleet.replay_control.append((side, method, data, md))
    what = f"{side.name} {method} md={md!r:.200} data={data[:400]!r} ({len(data)} bytes)"
    check_answer(fleet, side, method, out, resp_type, expect, what, len(data), sum(len(k) + len(v) for k, v in md))
    if method == UPDATE:
        assert policy_before is not None and log_before is not None
        policy_after = await get_policy(side)
        log_after = side.gw.policy_log.recent()
        if out.code != grpc.StatusCode.OK:
            if policy_after != policy_before or side.gw.cost.params is not params_before:
                tally.find(f"a refused UpdatePolicy ({out.code.name}) changed the policy", what)
            if log_after != log_before:
                tally.find(f"a refused UpdatePolicy ({out.code.name}) was logged", what)
        elif out.data is not None:
            check_update(fleet, out.data, data, policy_after, log_before, log_after, what)
    return out


def check_answer(fleet: Fleet, side: Side, method: str, out: Answer, resp_type: type[Message], expect: str | None,
                 what: str, size: int, md_size: int) -> None:
    tally = fleet.tally
    if out.code in BAD_CODES:
        tally.find(f"{out.code.name}: {out.details[:300]}", what)
    elif out.code == grpc.StatusCode.OK:
        if out.data is None or parses(out.data, resp_type) is None:
            tally.find(f"{method} answered OK with bytes that are no {resp_type.__name__}", what)
    elif not out.details and not method.startswith(OPEN_METHODS):  # grpc's health: NOT_FOUND, no details
        tally.find(f"{out.code.name} without details", what)
    if out.code == grpc.StatusCode.UNAVAILABLE and out.trailing.get("kvgate-error-code") != "no_healthy_worker":
        tally.find(f"UNAVAILABLE {out.trailing}: {out.details[:200]}", what)
    if out.code == grpc.StatusCode.RESOURCE_EXHAUSTED and size <= GRPC_LIMIT and md_size < METADATA_SOFT \
            and out.trailing.get("kvgate-error-code") != "request_too_large":
        tally.find(f"RESOURCE_EXHAUSTED for a message within the limit: {out.details[:200]}", what)
    if method.startswith(OPEN_METHODS) or method not in REQUESTS:
        return  # open, or unknown (UNIMPLEMENTED before the auth hook, as gRPC answers)
    if side.secured and expect == "refused" and out.code not in REFUSED | {grpc.StatusCode.RESOURCE_EXHAUSTED}:
        tally.find(f"a caller without an operator's credentials got {out.code.name} from {method}", what)
    if (expect == "operator" or not side.secured) and out.code in REFUSED:
        tally.find(f"an operator was refused ({out.code.name}: {out.details[:100]})", what)


def check_update(fleet: Fleet, answer: bytes, sent: bytes, policy_after: bytes, log_before: list[Any],
                 log_after: list[Any], what: str) -> None:
    tally = fleet.tally
    resp = parses(answer, ppb.UpdatePolicyResponse)
    req = parses(sent, ppb.UpdatePolicyRequest)
    if not isinstance(resp, ppb.UpdatePolicyResponse) or not isinstance(req, ppb.UpdatePolicyRequest):
        tally.find("an accepted UpdatePolicy whose request or answer does not parse", what)
        return
    bad = cost_bounded(resp.state.cost)
    if bad:
        tally.find(f"UpdatePolicy accepted out-of-bounds values {bad[:3]}", what)
    if resp.state.SerializeToString() != policy_after:
        tally.find("UpdatePolicy answered a state GetPolicy does not show", what)
    asked = {f.name: v for f, v in req.cost.ListFields()}
    got = {f.name: v for f, v in resp.state.cost.ListFields()}
    wrong = {k: (v, got.get(k)) for k, v in asked.items() if got.get(k) != v}
    if wrong:
        tally.find(f"UpdatePolicy accepted but did not set {list(wrong.items())[:3]}", what)
    if not asked:
        tally.find("UpdatePolicy accepted a change of nothing", what)
    if len(log_after) != min(len(log_before) + 1, 256) or log_after[-1].via != "grpc":
        tally.find("an accepted UpdatePolicy was not logged", what)


# --- decision watchers ----------------------------------------------------------------------------------

@dataclass
class WatchRun:
    side: Side
    filter: rpb.WatchDecisionsRequest | None
    call: Any
    task: asyncio.Task[None]
    what: str
    expect: str | None
    events: list[rpb.DecisionEvent] = field(default_factory=list)


async def open_watch(fleet: Fleet, side: Side, data: bytes, md: tuple[tuple[str, str | bytes], ...],
                     expect: str | None, deadline: float | None) -> None:
    fleet.tally.requests["control"] += 1
    mc: Any = side.control.unary_stream("/kvgate.v1.Routing/WatchDecisions",
                                        response_deserializer=rpb.DecisionEvent.FromString)
    call = mc(
        data, metadata=md, timeout=deadline or 4 * CALL_TIMEOUT_S)
    flt = parses(data, rpb.WatchDecisionsRequest)
    what = f"{side.name} WatchDecisions md={md!r:.200} data={data[:300]!r}"
    run = WatchRun(side, flt if isinstance(flt, rpb.WatchDecisionsRequest) else None, call,
                   asyncio.ensure_future(asyncio.sleep(0)), what, expect)

    async def read() -> None:
        async for ev in call:
            run.events.append(ev)

    run.task = asyncio.ensure_future(read())
    fleet.watches.append(run)
    while len([w for w in fleet.watches if not w.task.done()]) > 6:  # a few open at a time, oldest closed
        await close_watch(fleet, next(w for w in fleet.watches if not w.task.done()))
    await asyncio.sleep(0.01)  # let it start: decisions made meanwhile reach it


async def close_watch(fleet: Fleet, run: WatchRun) -> None:
    run.call.cancel()
    code = grpc.StatusCode.CANCELLED
    details = ""
    try:
        await run.task
    except grpc.aio.AioRpcError as exc:
        code, details = exc.code(), exc.details() or ""
    except asyncio.CancelledError:
        pass
    if run.task.done() and not run.task.cancelled() and run.task.exception() is None:
        code = await run.call.code()
    fleet.tally.codes[f"watch {code.name}"] += 1
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        pass  # the short deadlines some watchers are given
    elif code in BAD_CODES:
        fleet.tally.find(f"WatchDecisions ended {code.name}: {details[:300]}", run.what)
    if run.side.secured and run.expect == "refused" and code not in REFUSED | {grpc.StatusCode.CANCELLED,
                                                                                grpc.StatusCode.DEADLINE_EXCEEDED}:
        fleet.tally.find(f"a watcher without an operator's credentials ended {code.name}", run.what)
    if run.side.secured and run.expect == "refused" and run.events:
        fleet.tally.find("a watcher without an operator's credentials saw decisions", run.what)
    f = run.filter
    for ev in run.events:
        if f is None:
            fleet.tally.find("a watcher whose request does not parse saw decisions", run.what)
            break
        if (f.model and ev.model != f.model) or (f.tenant and ev.tenant != f.tenant) \
                or (f.conversation_id and ev.conversation_id != f.conversation_id) \
                or (ev.scores and not f.include_scores):
            fleet.tally.find(f"a watcher saw a decision its filter leaves out: {ev}", run.what)
            break
