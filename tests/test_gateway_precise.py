"""The cost-model policy in the gateway: tokens, block hashes, KV events and decisions end to end."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import MODEL
from tests.helpers import agent_turns, client, eventually, metric


async def test_precise_mode_follows_the_cache_and_predicts_it_exactly(make_cluster: Any) -> None:
    c = await make_cluster(3, events=True)
    await eventually(lambda: len(c.gateway.prefix.events.workers()) == 3)
    turns = await agent_turns(c, "p1", 5)
    assert len({t[0] for t in turns}) == 1
    assert [t[1] for t in turns[1:]] == ["cost_model:longest_prefix"] * 4
    # Events arrive before the next turn: the expected cached tokens are exactly what vLLM-style
    # accounting reports.
    assert all(t[3] == t[4] for t in turns[1:]) and turns[-1][3] > turns[1][3] > 0
    assert await metric(c, "kvgate_kv_events_applied_total") > 0
    # Counted in tokens, and the local count is the worker's.
    assert await metric(c, "kvgate_routed_prompt_tokens_total", tokenizer="local") == sum(t[2] for t in turns)


async def test_long_tool_outputs_routed_before_they_are_tokenized_are_predicted_exactly(make_cluster: Any) -> None:
    # Each tool output (~2,700 characters) is new text no worker can hold: the turn is routed on the
    # conversation's chain and the output's first block, and tokenized whole after it is sent; the turn's
    # chain, and so the next turn's prediction, is built from the whole prompt.
    c = await make_cluster(2, events=True)
    await eventually(lambda: len(c.gateway.prefix.events.workers()) == 2)
    turns = await agent_turns(c, "long1", 3, result_words=270, system="You are an agent. " * 20)
    assert len({t[0] for t in turns}) == 1
    assert all(t[3] == t[4] for t in turns[1:]) and turns[-1][4] > turns[1][4] > 0, turns
    assert await metric(c, "kvgate_routed_prompt_tokens_total", tokenizer="local") == sum(t[2] for t in turns)
    assert c.gateway.prompts.deferred == 2  # the second and third turns


@pytest.mark.skipif(os.environ.get("KVGATE_TEST_SIM_ENGINE") == "sglang",
                    reason="vLLM's hash algorithms, learned from vllm:cache_config_info (SGLang has one)")
async def test_a_mixed_fleet_is_matched_with_each_workers_own_hashes(make_cluster: Any) -> None:
    # One worker hashes with sha256 in blocks of 64, the other with sha256_cbor in blocks of 128; kvgate is
    # told neither (both left at 16 / sha256) and learns them from the workers' /metrics.
    c = await make_cluster(2, events=True, per_sim=[{"hash_algo": "sha256", "block_size": 64},
                                                    {"hash_algo": "sha256_cbor", "block_size": 128}],
                           worker={"block_size": 16, "hash_algo": "sha256"})
    await eventually(lambda: len(c.gateway.prefix.events.workers()) == 2)
    runs = await asyncio.gather(*(agent_turns(c, f"mix{i}", 4, system=f"You are agent {i}. " * 50)
                                  for i in range(4)))
    later = [t for run in runs for t in run[1:]]
    assert {t[0] for t in later} == {f"127.0.0.1:{h.port}" for _, h in c.sims}
    assert all(t[3] == t[4] for t in later) and all(t[3] > 0 for t in later), later
    assert await metric(c, "kvgate_worker_config_mismatches_total") == 3  # block size twice, sha256_cbor once
    assert await metric(c, "kvgate_worker_config_mismatches_total", field="hash_algo") == 1


async def test_approximate_mode_without_events(make_cluster: Any) -> None:
    c = await make_cluster(3, events=False)
    turns = await agent_turns(c, "a1", 4)
    assert len({t[0] for t in turns}) == 1 and all(t[3] > 0 for t in turns[1:])
    blocks = await metric(c, "kvgate_index_blocks", mode="approximate")
    assert blocks > 0


async def test_new_conversations_sharing_a_system_prompt_are_balanced(make_cluster: Any) -> None:
    c = await make_cluster(3, events=True, sim={"speed": 2.0})
    await eventually(lambda: len(c.gateway.prefix.events.workers()) == 3)
    await agent_turns(c, "warm", 1)
    oc = client(c)

    async def one(i: int) -> str:
        raw = await oc.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "system", "content": "You are an agent. " * 60},
                                   {"role": "user", "content": f"new task {i} " * 30}],
            extra_headers={"x-conversation-id": f"n{i}"}, extra_body={"sim": {"reasoning_tokens": 200}})
        return raw.headers["x-kvgate-worker"]

    placed = await asyncio.gather(*(one(i) for i in range(9)))
    # All share the cached system prompt, but piling nine concurrent prefills on one worker would
    # cost more than recomputing 700 tokens elsewhere.
    assert len(set(placed)) == 3


async def test_concurrent_first_turns_sharing_a_system_prompt_see_each_other(make_cluster: Any) -> None:
    c = await make_cluster(1, events=True, sim={"speed": 0.2})
    await eventually(lambda: len(c.gateway.prefix.events.workers()) == 1)
    sim = c.sims[0][0]
    oc = client(c)
    system = "You are an agent. " * 60

    async def first_turn(i: int) -> tuple[int, int]:
        raw = await oc.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "system", "content": system}, {"role": "user", "content": f"task {i}"}],
            extra_headers={"x-conversation-id": f"f{i}"}, max_tokens=4)
        r = raw.parse()
        assert r.usage is not None and r.usage.prompt_tokens_details is not None
        return int(raw.headers["x-kvgate-expected-cached-tokens"]), r.usage.prompt_tokens_details.cached_tokens or 0

    a = asyncio.create_task(first_turn(0))
    # The second arrives while the first one's prefill runs: its blocks are not reported yet, but they
    # will be cached by the time the second is scheduled.
    await eventually(lambda: sim.core.num_running == 1)
    assert c.gateway.prefix.index.block_count() == 0
    expected, cached = await first_turn(1)
    assert cached > 0 and expected == cached
    assert await a == (0, 0)


async def test_untokenizable_request_is_still_served(make_cluster: Any) -> None:
    c = await make_cluster(2, events=True, tokenizer=False)
    # A batch of string prompts has no single /tokenize equivalent: routed on an estimate.
    async with httpx.AsyncClient() as h:
        r = await h.post(c.url + "/v1/completions", json={"model": MODEL, "prompt": ["a b c", "d e f"],
                                                          "max_tokens": 2})
    assert r.status_code != 503 and r.status_code < 500
    assert await metric(c, "kvgate_routed_prompt_tokens_total", tokenizer="estimate") > 0
    # Without a local tokenizer the worker's /tokenize is used.
    r = await client(c).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=2)
    assert r.usage is not None
    assert await metric(c, "kvgate_routed_prompt_tokens_total", tokenizer="worker") == r.usage.prompt_tokens


async def test_tokenizer_parity_mismatch_falls_back_to_worker(make_cluster: Any, tmp_path: Any) -> None:
    import json
    import shutil

    from tests.conftest import MODEL as M

    bad = tmp_path / "bad-tok"
    shutil.copytree(c_dir := __import__("kvgate.tokens.tinymodel", fromlist=["x"]).ensure_tiny_model(), bad)
    del c_dir
    cfg = json.loads((bad / "tokenizer_config.json").read_text())
    cfg["chat_template"] = cfg["chat_template"].replace("<|im_start|>", "<|im_start|> ")
    (bad / "tokenizer_config.json").write_text(json.dumps(cfg))
    c = await make_cluster(2, events=True, tokenizers={M: str(bad)})
    assert c.gateway.prompts.mode[M] == "worker"
    assert await metric(c, "kvgate_tokenizer_parity_failures_total", model_name=M) == 1
    r = await client(c).chat.completions.create(model=M, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert r.choices


async def test_admin_policy_patch_validates_and_applies(make_cluster: Any) -> None:
    c = await make_cluster(1)
    async with httpx.AsyncClient() as h:
        before = (await h.get(c.url + "/admin/policy")).json()
        assert before["policy"] == "cost_model"
        bad = await h.patch(c.url + "/admin/policy", json={"cost": {"token_budget": -5, "affinity_bonus_ms": 9}})
        assert bad.status_code == 422 and bad.json()["error"]["param"] == "cost.token_budget"
        assert (await h.get(c.url + "/admin/policy")).json() == before  # nothing half-applied
        ok = await h.patch(c.url + "/admin/policy", json={"cost": {"affinity_bonus_ms": 9}})
        assert ok.status_code == 200 and ok.json()["cost"]["affinity_bonus_ms"] == 9
        assert c.gateway.cost.params.affinity_bonus_ms == 9
        unknown = await h.patch(c.url + "/admin/policy", json={"cost": {"warp_factor": 9}})
        assert unknown.status_code == 422
        # Tool-wait and background-prefill thresholds (what kvgate tune proposes), all sections at once.
        both = await h.patch(c.url + "/admin/policy", json={"waits": {"reserve_max_s": 2.5},
                                                            "prefill": {"min_continue": 0.6, "enabled": True}})
        assert both.status_code == 200 and both.json()["waits"]["reserve_max_s"] == 2.5
        rt = c.gateway.runtime
        assert rt.learned.waits.params.reserve_max_s == 2.5 and rt.controller.params.prefill.min_continue == 0.6
        assert rt.learned.continues.params.min_continue == 0.6 and rt.controller.params.prefill.enabled
        half = await h.patch(c.url + "/admin/policy", json={"waits": {"reserve_max_s": 1},
                                                            "prefill": {"min_continue": 2}})
        assert half.status_code == 422 and half.json()["error"]["param"] == "prefill.min_continue"
        assert rt.learned.waits.params.reserve_max_s == 2.5  # nothing half-applied
        other = await h.patch(c.url + "/admin/policy", json={"routing": {"x": 1}})
        assert other.status_code == 400 and other.json()["error"]["param"] == "routing"


async def test_kv_event_gap_is_replayed(make_cluster: Any) -> None:
    c = await make_cluster(1, events=True)
    await eventually(lambda: len(c.gateway.prefix.events.workers()) == 1)
    sim = c.sims[0][0]
    assert sim.publisher is not None
    await agent_turns(c, "g0", 1)
    await eventually(lambda: c.gateway.prefix.events.stats.batches > 0)
    # Lose a batch on the wire: publish it into the replay buffer only.
    from kvgate.router.hashing import BlockHash
    from kvgate.sim.blockpool import BlockStored

    lost = BlockStored((BlockHash(b"\x01" * 32),), None, tuple(range(128)), 128)
    seq = next(sim.publisher._seq)
    from kvgate.sim.events import encode_batch

    sim.publisher._buffer.append((seq, encode_batch([lost], 0.0)))
    await agent_turns(c, "g1", 1)  # the next live batch reveals the gap
    await eventually(lambda: c.gateway.prefix.events.stats.gaps == 1)
    await eventually(lambda: c.gateway.prefix.index.match([int.from_bytes(b"\x01" * 8, "big")]) != {})
    assert c.gateway.prefix.events.stats.replays_failed == 0


async def test_expected_vs_actual_metric(make_cluster: Any) -> None:
    c = await make_cluster(2, events=True)
    await eventually(lambda: len(c.gateway.prefix.events.workers()) == 2)
    await agent_turns(c, "m1", 3)
    assert await metric(c, "kvgate_expected_vs_actual_cached_tokens_count", policy="cost_model") == 3
    assert await metric(c, "kvgate_expected_cached_tokens_total", policy="cost_model") > 0


_ = openai


async def test_a_fleet_of_vllm_and_sglang_workers_is_routed_precisely_to_both(make_cluster: Any) -> None:
    # One simulated vLLM worker and one simulated SGLang worker of the same model: each is matched with its
    # own engine's page identities and KV events, so every expectation equals what the worker reports.
    c = await make_cluster(2, events=True, per_sim=[{"engine": "vllm"}, {"engine": "sglang"}])
    await eventually(lambda: len(c.gateway.prefix.events.workers()) == 2)
    runs = await asyncio.gather(*(agent_turns(c, f"both{i}", 4, system=f"You are agent {i}. " * 50)
                                  for i in range(4)))
    later = [t for run in runs for t in run[1:]]
    assert {t[0] for t in later} == {f"127.0.0.1:{h.port}" for _, h in c.sims}  # both kinds served
    assert all(t[3] == t[4] > 0 for t in later), later
