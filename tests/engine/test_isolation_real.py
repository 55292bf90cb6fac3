"""Tenant isolation through a real vLLM worker (issue 11): kvgate's per-tenant cache_salt keeps one
tenant's cached prefix out of another's reach, a sharing group shares it, and kvgate's expectation of
the cached length (its own salted block hashes) equals what vLLM reports."""

from __future__ import annotations

from typing import Any

import httpx

from kvgate.assembly import create_app
from kvgate.config import GatewaySettings, WorkerConfig
from kvgate.gateway.auth import key_hash
from kvgate.serving import start_server
from kvgate.settings.auth import AuthSettings
from tests.engine.conftest import Pair, reset_cache

DOC = "Tenant A's design document: the storage layer shards by customer and replicates thrice. " * 30
KEYS = {"key-a": "A", "key-b": "B", "key-c": "C"}


async def test_no_cross_tenant_hits_on_real_vllm(pair: Pair) -> None:
    w = pair.a  # one worker: every tenant's request lands where A's document is cached
    await reset_cache(w.url)
    auth = AuthSettings(mode="api_key", cache_salt_secret="engine-secret",
                        sharing_groups={"platform": ["A", "C"]},
                        api_keys=[{"sha256": key_hash(k), "tenant": t} for k, t in KEYS.items()])
    settings = GatewaySettings(
        workers=[WorkerConfig(url=w.url, model="kvgate-tiny", engine="vllm", block_size=128,
                              hash_algo=w.spec.hash_algo, kv_events=w.events, kv_replay=w.replay)],
        tokenizers={"kvgate-tiny": str(pair.model)}, hash_seed="0", health_interval_s=1.0, auth=auth)
    gw = await start_server(create_app(settings))
    try:
        async def ask(key: str, conv: str, q: str) -> tuple[int, int, int]:
            async with httpx.AsyncClient(timeout=120) as c:
                r = await c.post(gw.url + "/v1/chat/completions", headers={
                    "authorization": f"Bearer {key}", "x-conversation-id": conv}, json={
                    "model": "kvgate-tiny", "max_tokens": 4, "temperature": 0,
                    "messages": [{"role": "system", "content": DOC}, {"role": "user", "content": q}],
                    "chat_template_kwargs": {"enable_thinking": False}})
            assert r.status_code == 200, r.text
            u: dict[str, Any] = r.json()["usage"]
            return (u["prompt_tokens"], int((u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0),
                    int(r.headers["x-kvgate-expected-cached-tokens"]))

        first = await ask("key-a", "a1", "summarise it")
        a_again = await ask("key-a", "a2", "what replicates?")
        b = await ask("key-b", "b1", "what replicates?")
        c = await ask("key-c", "c1", "how is it sharded?")
        print(f"real vLLM (prompt, cached, kvgate expected): A first {first}, A repeat {a_again}, B {b}, "
              f"C (A's group) {c}")
        assert a_again[1] >= 512 and a_again[1] == a_again[2]
        assert b[1] == 0 and b[2] == 0
        assert c[1] >= 512 and c[1] == c[2]
    finally:
        await gw.stop()
