"""Tenant isolation (issue 11): a conversation, its response ids and its cached prefix belong to one tenant.
A real gateway in front of simulated vLLM workers, which salt their block hashes as vLLM does."""

from __future__ import annotations

from typing import Any

import httpx

from kvgate.gateway.auth import key_hash, salt_for, tenant_salt
from kvgate.settings.auth import AuthSettings
from tests.conftest import MODEL, Cluster

SECRET = "isolation-secret"
KEYS = {"key-a": ("A", "tenant"), "key-b": ("B", "tenant"), "key-c": ("C", "tenant"), "key-ops": ("O", "operator")}
DOC = "The quarterly report of tenant A, strictly confidential. " * 40


def auth(**kw: Any) -> dict[str, Any]:
    return {"mode": "api_key", "cache_salt_secret": SECRET, "sharing_groups": {"platform": ["A", "C"]},
            "api_keys": [{"sha256": key_hash(k), "tenant": t, "role": r, "name": k} for k, (t, r) in KEYS.items()],
            **kw}


async def chat(c: Cluster, key: str, conv: str, messages: list[dict[str, Any]], **extra: Any) -> httpx.Response:
    async with httpx.AsyncClient(timeout=30) as cl:
        return await cl.post(c.url + "/v1/chat/completions", json={"model": MODEL, "messages": messages, **extra},
                             headers={"authorization": f"Bearer {key}", "x-conversation-id": conv})


async def get(c: Cluster, key: str, path: str) -> httpx.Response:
    async with httpx.AsyncClient(timeout=30) as cl:
        return await cl.get(c.url + path, headers={"authorization": f"Bearer {key}"})


def cached(r: httpx.Response) -> int:
    assert r.status_code == 200, r.text
    return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def doc(question: str) -> list[dict[str, Any]]:
    return [{"role": "system", "content": DOC}, {"role": "user", "content": question}]


async def test_another_tenants_conversation_is_not_found(make_cluster: Any) -> None:
    c = await make_cluster(1, auth=auth())
    r1 = await chat(c, "key-b", "conv", [{"role": "user", "content": "B's own"}])  # same id, B's own record
    r = await chat(c, "key-a", "conv", doc("summarise"))
    assert r.status_code == 200 and r.headers["x-kvgate-conversation-id"] == "A/conv"
    rid = r.json()["id"]
    # Reading: B gets its own "conv", never A's, by any spelling of the id; A reads its own.
    assert (await get(c, "key-b", "/admin/conversations/A/conv")).status_code == 404
    own = await get(c, "key-b", "/admin/conversations/conv")
    assert own.status_code == 200 and own.json()["tenant"] == "B" and own.json()["responses"] == [r1.json()["id"]]
    mine = await get(c, "key-a", "/admin/conversations/conv")
    assert mine.status_code == 200 and mine.json()["tenant"] == "A"
    assert (await get(c, "key-ops", "/admin/conversations/A/conv")).json()["tenant"] == "A"
    # Continuing: A's response id does not exist for B.
    r = await chat(c, "key-b", "x", [{"role": "user", "content": "and then?"}], previous_response_id=rid)
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"
    r = await chat(c, "key-a", "x", [{"role": "user", "content": "and then?"}], previous_response_id=rid)
    assert r.status_code == 200 and r.headers["x-kvgate-conversation-id"] == "A/conv"
    # The next-turn prefix hands out token ids: operators only.
    assert (await get(c, "key-b", "/admin/conversations/A/conv/next-prefix")).status_code == 403
    assert (await get(c, "key-a", "/admin/conversations/A/conv/next-prefix")).status_code == 403
    assert (await get(c, "key-ops", "/admin/conversations/A/conv/next-prefix")).status_code == 200


async def test_no_cache_hits_across_tenants_but_within_one_and_a_sharing_group(make_cluster: Any) -> None:
    # One worker: every request lands where A's document is cached, the case a salt must cover.
    c = await make_cluster(1, auth=auth(), events=True)
    first = await chat(c, "key-a", "a1", doc("q1"))
    assert cached(first) == 0
    a_again = await chat(c, "key-a", "a2", doc("q2"))
    b = await chat(c, "key-b", "b1", doc("q2"))
    shared = await chat(c, "key-c", "c1", doc("q3"))
    print(f"cached tokens: A repeat {cached(a_again)}, B {cached(b)}, C (A's group) {cached(shared)}, "
          f"prompt {a_again.json()['usage']['prompt_tokens']}")
    assert cached(a_again) >= 400
    assert cached(b) == 0
    assert cached(shared) >= 400
    # kvgate's own expectation agrees with the engine's: it hashes with the same salt.
    assert int(a_again.headers["x-kvgate-expected-cached-tokens"]) >= 400
    assert b.headers["x-kvgate-expected-cached-tokens"] == "0"


async def test_a_client_cannot_choose_its_salt(make_cluster: Any) -> None:
    c = await make_cluster(1, auth=auth())
    assert cached(await chat(c, "key-a", "a1", doc("q1"))) == 0
    a_salt = tenant_salt(AuthSettings.model_validate(auth()), "A")
    # B sends A's salt (it cannot know it, but even so) and no salt at all: both overridden with B's own.
    assert cached(await chat(c, "key-b", "b1", doc("q2"), cache_salt=a_salt)) == 0
    assert cached(await chat(c, "key-b", "b2", doc("q3"), cache_salt="")) >= 400  # B's own prefix now


async def test_expected_cached_tokens_hidden_when_unsalted(make_cluster: Any) -> None:
    c = await make_cluster(1, auth=auth(cache_salt=False))
    await chat(c, "key-a", "a1", doc("q1"))
    r = await chat(c, "key-b", "b1", doc("q2"))
    assert r.status_code == 200
    # Unsalted, kvgate's match would count A's prefix: B is not told.
    assert "x-kvgate-expected-cached-tokens" not in r.headers
    assert "x-kvgate-prefix-reuse" not in r.headers


def test_salt_is_per_tenant_or_group_and_keyed() -> None:
    groups = {"platform": ["A", "C"]}
    assert salt_for(b"k", "A", groups) == salt_for(b"k", "C", groups)
    assert salt_for(b"k", "A", groups) != salt_for(b"k", "B", groups)
    assert salt_for(b"k", "B", groups) != salt_for(b"other", "B", groups)
    # A tenant named like a group cannot take the group's salt.
    assert salt_for(b"k", "platform", groups) != salt_for(b"k", "A", groups)


async def test_the_remote_tier_probe_sees_only_the_callers_salt() -> None:
    """LMCache keys a salted chunk ``...@<hash>@<salt>``: kvgate probes under the request's own salt, so a
    tenant's routing never reflects another tenant's chunks in Redis."""
    import redis

    from kvgate.kvstore.tiers import RemoteTierProbe
    from kvgate.router.hashing import LMCacheKeys

    model, toks = "/models/kvgate-isolation-probe", list(range(1, 800))  # 3 full 256-token chunks
    groups = {"platform": ["A", "C"]}
    salt_a, salt_b, salt_c = (salt_for(b"k", t, groups) for t in "ABC")
    written = LMCacheKeys(model).redis_keys(toks, salt_a)
    assert all(k.endswith("@" + salt_a) for k in written)
    r = redis.Redis()
    r.set(written[0], b"kv")
    r.set(written[1], b"kv")
    probe = RemoteTierProbe("redis://127.0.0.1:6379/0", lambda: 0.0)
    try:
        assert await probe.prefix_tokens(model, toks, salt_a) == 512
        assert await probe.prefix_tokens(model, toks, salt_c) == 512  # A's sharing group
        assert await probe.prefix_tokens(model, toks, salt_b) == 0
        assert await probe.prefix_tokens(model, toks) == 0  # unsalted
    finally:
        await probe.aclose()
        r.delete(*written[:2])
