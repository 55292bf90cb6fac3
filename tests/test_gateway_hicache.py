"""SGLang's HiCache host pool in routing: a conversation pushed off the worker's GPU but still in its host
pool (its ``CPU_PINNED`` events say so) is priced as a CPU-tier hit, and what the gateway expected is what
the worker then reports cached (the host pages are loaded back, not recomputed)."""

from typing import Any

import httpx

from tests.conftest import MODEL

SIM = {"speed": 20.0, "engine": "sglang", "block_size": 16, "num_blocks": 64, "hicache_ratio": 8.0}


def chat(conv: str, words: int) -> dict[str, Any]:
    text = " ".join(f"{conv}{i}" for i in range(words))
    return {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": text}]}


async def test_a_conversation_in_the_host_pool_is_a_cpu_tier_hit(make_cluster: Any) -> None:
    c = await make_cluster(n=1, sim=SIM, events=True)
    async with httpx.AsyncClient(base_url=c.url, timeout=30) as h:
        first = await h.post("/v1/chat/completions", json=chat("a", 300), headers={"x-conversation-id": "a"})
        assert first.status_code == 200, first.text
        prompt = first.json()["usage"]["prompt_tokens"]
        assert prompt > 512  # more than half the 1,024-token GPU: two others push it out
        for other in ("b", "c", "f"):  # same length as "a" (d, e, g tokenize longer)
            r = await h.post("/v1/chat/completions", json=chat(other, 300), headers={"x-conversation-id": other})
            assert r.status_code == 200, r.text
        again = await h.post("/v1/chat/completions", json=chat("a", 300), headers={"x-conversation-id": "a"})
    assert again.status_code == 200, again.text
    cached = again.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    expected = int(again.headers["x-kvgate-expected-cached-tokens"])
    assert again.headers["x-kvgate-route-tier"] == "cpu", dict(again.headers)
    assert cached >= prompt - 16 and expected == cached
