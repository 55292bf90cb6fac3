"""The session lifecycle, reservations, background prefill, tier faults and the tenants' parked-KV and
background-prefill budgets through the gateway."""

from __future__ import annotations

import uuid
from typing import Any

import httpx

from kvgate.kvstore.tiers import LMCacheControl
from kvgate.router.types import ConversationId, WorkerId
from kvgate.session.controller import Reserve
from kvgate.session.prefill import gain_tokens
from kvgate.session.state import LAPSE, PREFETCH
from tests.conftest import MODEL, Cluster, free_port
from tests.helpers import TOOLS, chat, eventually, metric, ready

REDIS = "redis://127.0.0.1:6379/0"


async def admin(c: Cluster, path: str) -> Any:
    async with httpx.AsyncClient() as h:
        return (await h.get(c.url + path)).json()


async def test_tool_wait_reserves_kv_and_is_measured_when_the_session_resumes(make_cluster: Any) -> None:
    c = await make_cluster(2, events=True, waits={"tool_priors_s": {"search": 1.0}, "reserve_max_s": 5.0})
    await ready(c)
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "agent " * 200}, {"role": "user", "content": "go"}]
    r1 = await chat(c, "tw", msgs, sim={"tool_calls": [{"name": "search", "arguments": {"q": "x"}}]})
    assert r1.status_code == 200
    home = r1.headers["x-kvgate-worker"]
    conv = await admin(c, "/admin/conversations/tw")
    life = conv["lifecycle"]
    assert life["state"] == "awaiting_tool" and life["tools"] == ["search"]
    assert life["plan"][0] == 1.0 and life["plan"][1] == "reserve"
    workers = {w["id"]: w for w in (await admin(c, "/admin/workers"))["workers"]}
    usage = r1.json()["usage"]
    assert workers[home]["reserved_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]

    m = r1.json()["choices"][0]["message"]
    msgs += [{k: v for k, v in m.items() if v is not None},
             {"role": "tool", "tool_call_id": m["tool_calls"][0]["id"], "content": "found it"}]
    r2 = await chat(c, "tw", msgs, sim={"tool_calls": 0})
    assert r2.status_code == 200 and r2.headers["x-kvgate-worker"] == home
    assert (await admin(c, "/admin/conversations/tw"))["lifecycle"]["state"] == "awaiting_user"
    workers = {w["id"]: w for w in (await admin(c, "/admin/workers"))["workers"]}
    assert all(w["reserved_tokens"] == 0 for w in workers.values())
    assert await metric(c, "kvgate_tool_waits_total", outcome="within") == 1
    assert (await admin(c, "/admin/tiers"))["waits"]["observed"] == 1


def reply(r: httpx.Response) -> dict[str, Any]:
    return {k: v for k, v in r.json()["choices"][0]["message"].items() if v is not None}


async def tool_chain_then_answer(c: Cluster, conv: str, tenant: str | None = None
                                 ) -> tuple[list[dict[str, Any]], httpx.Response, httpx.Response]:
    """A turn whose tool call carries long reasoning and whose answer ends it: the next user turn drops
    that reasoning. Returns the history so far and the two responses."""
    h = {"x-tenant-id": tenant} if tenant is not None else None
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "agent " * 200}, {"role": "user", "content": "go"}]
    r1 = await chat(c, conv, msgs, h, sim={"tool_calls": 1, "reasoning_tokens": 400})
    m = reply(r1)
    msgs += [m, {"role": "tool", "tool_call_id": m["tool_calls"][0]["id"], "content": "result " * 150}]
    r2 = await chat(c, conv, msgs, h, sim={"tool_calls": 0, "reasoning_tokens": 100, "answer_tokens": 40})
    return [*msgs, reply(r2), {"role": "user", "content": "thanks, and now?"}], r1, r2


async def test_background_prefill_makes_the_next_user_turn_find_the_canonical_prefix(make_cluster: Any) -> None:
    c = await make_cluster(1, events=True, prefill={"enabled": True, "min_gain_tokens": 128, "min_continue": 0.5})
    await ready(c)
    msgs, _, r2 = await tool_chain_then_answer(c, "bp")
    assert r2.status_code == 200
    # The turn ended: the next request drops this turn's reasoning, so kvgate prefills P|A now.
    async def prefilled() -> bool:
        return await metric(c, "kvgate_prefills_total", outcome="completed") == 1

    await eventually(prefilled, timeout_s=10)
    assert await metric(c, "kvgate_prefill_decisions_total", reason="issued") == 1
    async with httpx.AsyncClient() as h:
        prefix = (await h.get(c.url + "/admin/conversations/bp/next-prefix")).json()["tokens"]
    r3 = await chat(c, "bp", msgs, sim={"tool_calls": 0})
    cached = r3.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= prefix // 16 * 16 - 16, (cached, prefix)
    tiers = await admin(c, "/admin/tiers")
    assert tiers["prefill"]["used"] == 1 and tiers["prefill"]["wasted"] == 0


async def test_without_prefill_the_same_turn_recomputes_the_answer(make_cluster: Any) -> None:
    c = await make_cluster(1, events=True)
    await ready(c)
    msgs, r1, _ = await tool_chain_then_answer(c, "np")
    async with httpx.AsyncClient() as h:
        prefix = (await h.get(c.url + "/admin/conversations/np/next-prefix")).json()["tokens"]
    r3 = await chat(c, "np", msgs, sim={"tool_calls": 0})
    # Reused only up to the first dropped reasoning (inside turn 1's first reply), far short of P|A.
    cached = r3.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached <= r1.json()["usage"]["prompt_tokens"] < prefix - 128
    assert await metric(c, "kvgate_prefills_total") == 0


async def test_a_dead_remote_tier_is_counted_and_requests_go_on(make_cluster: Any) -> None:
    c = await make_cluster(2, events=True, tier_redis_url=f"redis://127.0.0.1:{free_port()}/0")
    await ready(c)
    for i in range(3):
        r = await chat(c, f"dead-{i}", [{"role": "user", "content": f"task {i} " * 200}], sim={"tool_calls": 0})
        assert r.status_code == 200
    assert await metric(c, "kvgate_tier_lookups_total", tier="remote", state="down") >= 1
    tiers = await admin(c, "/admin/tiers")
    assert tiers["remote_tier"]["up"] is False and tiers["remote_tier"]["errors"] == 1  # one timeout, then skipped


async def test_a_dead_lmcache_fails_the_prefetch_not_the_request(make_cluster: Any) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    c = await make_cluster(1, events=True, waits={"tool_priors_s": {"search": 0.6}, "reserve_max_s": 0.1,
                                                  "prefetch_lead_s": 0.5})
    for w in c.gateway.settings.workers:  # the worker's LMCache server is not running
        c.gateway.tiers.lmcache[w.id] = LMCacheControl(dead, c.gateway.client, c.gateway.clock.now)
    await ready(c)
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "agent " * 200}, {"role": "user", "content": "go"}]
    r1 = await chat(c, "pf", msgs, sim={"tool_calls": [{"name": "search", "arguments": {"q": "x"}}]})
    life = (await admin(c, "/admin/conversations/pf"))["lifecycle"]
    assert life["plan"][1] == "release"  # a 0.6 s wait is "long" here: prefetch at +0.1 s

    async def failed() -> bool:
        return await metric(c, "kvgate_tier_prefetches_total", outcome="failed") == 1

    await eventually(failed)
    m = r1.json()["choices"][0]["message"]
    msgs += [{k: v for k, v in m.items() if v is not None},
             {"role": "tool", "tool_call_id": m["tool_calls"][0]["id"], "content": "ok"}]
    assert (await chat(c, "pf", msgs, sim={"tool_calls": 0})).status_code == 200
    tiers = await admin(c, "/admin/tiers")
    assert all(not v["up"] and v["errors"] == 1 for v in tiers["lmcache"].values())


# -- tenant budgets (docs/admission.md) ---------------------------------------------------------------
SEARCH = {"tool_calls": [{"name": "search", "arguments": {"q": "x"}}]}
SHORT_WAITS = {"tool_priors_s": {"search": 1.0}, "reserve_max_s": 5.0}


async def tool_call(url: str, tenant: str, conv: str, system: str) -> httpx.Response:
    body = {"model": MODEL, "tools": TOOLS, "sim": SEARCH,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": "go"}]}
    async with httpx.AsyncClient(timeout=30) as h:
        r = await h.post(url + "/v1/chat/completions", json=body,
                         headers={"x-tenant-id": tenant, "x-conversation-id": conv})
    assert r.status_code == 200, r.text
    return r


def kv(r: httpx.Response) -> int:
    u = r.json()["usage"]
    return int(u["prompt_tokens"] + u["completion_tokens"])


# A reservation lapses after deadline_factor x the predicted wait: with SHORT_WAITS, 2 s after it was made,
# which a loaded machine spends on the three requests and admin reads before the assertions (a1's KV was
# released and reserved_by("A") read 0). Waits predicted at 5 min keep every reservation past any test.
LONG_WAITS = {"tool_priors_s": {"search": 300.0}, "reserve_max_s": 600.0}


async def test_a_tenants_second_parked_wait_over_its_budget_is_released_on_every_replica(make_cluster: Any) -> None:
    # Two replicas on one Redis: the second learns of the first's reservation only through the fleet store.
    c = await make_cluster(2, events=True, replicas=2, session_store="redis", redis_url=REDIS,
                           redis_prefix=f"kvgate-test:{uuid.uuid4().hex[:8]}:", waits=LONG_WAITS,
                           admission={"enabled": True, "defaults": {"max_parked_kv_tokens": 1000}})
    await ready(c)
    a1 = await tool_call(c.urls[0], "A", "a1", "agent " * 50)
    a2 = await tool_call(c.urls[1], "A", "a2", "agent " * 200)
    b1 = await tool_call(c.urls[1], "B", "b1", "agent " * 200)
    assert kv(a1) + kv(a2) > 1000 >= kv(a2) == kv(b1)  # a2 alone would fit: it is A's first one that fills it
    plans = {cid: (await admin(c, f"/admin/conversations/{cid}"))["lifecycle"]["plan"][1]
             for cid in ("A/a1", "A/a2", "B/b1")}
    assert plans == {"A/a1": "reserve", "A/a2": "release", "B/b1": "reserve"}
    assert await metric(c, "kvgate_wait_plans_total", action="over_budget") == 0  # replica 0 planned a1 only
    async with httpx.AsyncClient() as h:
        text = (await h.get(c.urls[1] + "/metrics")).text
    assert 'kvgate_wait_plans_total{action="over_budget"} 1.0' in text
    # Every replica's view of the workers holds a1's and b1's KV, not a2's.
    fleet = c.gateway.fleet
    assert await fleet.reserved_by("A", 0.0) == kv(a1) and await fleet.reserved_by("B", 0.0) == kv(b1)

    async def every_replica_sees_both() -> bool:
        async with httpx.AsyncClient() as h:
            views = [(await h.get(u + "/admin/workers")).json()["workers"] for u in c.urls]
        return all(sum(w["reserved_tokens"] for w in v) == kv(a1) + kv(b1) for v in views)

    await eventually(every_replica_sees_both)


async def test_a_reservation_the_fleet_store_refuses_is_dropped_from_the_record(make_cluster: Any) -> None:
    """The race two replicas can run: the controller planned within the budget, and another replica
    reserved for the tenant before this one wrote. Replayed here: the planned Reserve meets a store in
    which the tenant's budget is taken."""
    c = await make_cluster(1, events=True, waits=SHORT_WAITS,
                           admission={"enabled": True, "defaults": {"max_parked_kv_tokens": 1000}})
    await ready(c)
    gw, cid = c.gateway, ConversationId("A/a1")
    r = await tool_call(c.url, "A", "a1", "agent " * 50)
    conv = await gw.store.get(cid)
    assert conv is not None and conv.session.reservation is not None
    res, home = conv.session.reservation, WorkerId(r.headers["x-kvgate-worker"])
    # The tick would resync this replica's worker view from the store; stopped, the view shows only what
    # the commands do.
    await gw.runtime.aclose()
    await gw.fleet.unreserve(home, cid, tenant="A")
    gw.runtime.actions.reserve_locally(home, -res.tokens)
    assert gw.pool.get(home).reserved == 0
    assert await gw.fleet.reserve(home, ConversationId("A/other"), 1000, until=res.until, tenant="A",
                                  now=0.0, budget=1000)
    await gw.runtime.execute(cid, conv, [Reserve(home, res.tokens, res.until, res.token)])
    after = await gw.store.get(cid)
    assert after is not None and after.session.reservation is None
    assert after.session.timer(LAPSE) is None and after.session.timer(PREFETCH) is not None
    assert after.session.lifecycle.plan is not None and after.session.lifecycle.plan.action == "release"
    assert await gw.fleet.reserved_by("A", 0.0) == 1000  # the other conversation's, untouched
    assert gw.pool.get(home).reserved == 0  # neither counted by the refused Reserve nor taken off again
    assert await metric(c, "kvgate_tool_waits_total", outcome="reservation_refused") == 1


async def test_a_tenants_prefill_budget_bounds_its_background_prefills(make_cluster: Any) -> None:
    c = await make_cluster(1, events=True, prefill={"enabled": True, "min_gain_tokens": 128, "min_continue": 0.5},
                           admission={"enabled": True, "tenants": {"lean": {"prefill_tokens_per_minute": 100},
                                                                   "metered": {"prefill_tokens_per_minute": 300}}})
    await ready(c)
    gw = c.gateway

    async def decided(n: int) -> None:
        async def done() -> bool:
            c = gw.runtime.counters
            return sum(v for (name, _), v in c.items() if name == "prefill_decisions") == n
        await eventually(done, timeout_s=10)

    await tool_chain_then_answer(c, "free-1", tenant="free")  # no budget
    await decided(1)
    conv = await gw.store.get(ConversationId("free/free-1"))
    assert conv is not None and conv.home is not None
    got = await gw.runtime.actions.next_prefix(conv)
    assert got is not None
    gain = gain_tokens(got[0], len(got[1]), gw.runtime.actions.block_size(conv.home))
    assert 100 < gain <= 300 < 2 * gain, gain  # what the budgets below are set for (each turn here has this gain)
    await tool_chain_then_answer(c, "lean-1", tenant="lean")  # 100 a minute: never the gain
    await decided(2)
    await tool_chain_then_answer(c, "metered-1", tenant="metered")  # the gain fits once...
    await decided(3)
    await tool_chain_then_answer(c, "metered-2", tenant="metered")  # ...and is charged: the bucket refills
    await decided(4)  # 5 tokens a second, so it holds the gain again only ~40 s after the charge
    assert await metric(c, "kvgate_prefill_decisions_total", reason="issued") == 2
    assert await metric(c, "kvgate_prefill_decisions_total", reason="over_budget") == 2
    assert gw.admission is not None
    assert await gw.admission.store.level("metered", "prefill", 300) < gain
    assert await gw.admission.store.level("free", "prefill", 300) == 300  # nothing charged without a budget
