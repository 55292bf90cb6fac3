"""The harnesses' own session keys end to end: the openai client sends only what Claude Code, Codex or
OpenCode send, through the gateway to simulated workers."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from tests.conftest import MODEL
from tests.helpers import client, metric, run_agent


@pytest.mark.parametrize("header", ["x-claude-code-session-id", "session-id", "x-session-affinity"])
async def test_a_harness_session_header_alone_is_one_conversation(make_cluster: Any, header: str) -> None:
    c = await make_cluster(3, policy="session_affinity")
    oc = client(c)
    turns = await run_agent(oc, None, 4, headers={header: "run-7f3a"})
    assert len({w for w, _, _ in turns}) == 1
    assert all(b > a for (_, _, a), (_, _, b) in itertools.pairwise(turns))
    assert await metric(c, "kvgate_conversation_id_source_total", source="header") == 4
    conv = await c.gateway.runtime.store.get("run-7f3a")  # type: ignore[arg-type]
    assert conv is not None and conv.id_source == f"header:{header}" and len(conv.turns) == 4


async def test_a_new_sub_agent_starts_on_its_parents_worker(make_cluster: Any) -> None:
    c = await make_cluster(3, policy="session_affinity")
    oc = client(c)
    parent = await run_agent(oc, None, 2, headers={"x-claude-code-session-id": "S"})
    home = parent[0][0]
    for agent in ("a1", "a2", "a3", "a4", "a5", "a6"):
        raw = await oc.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": f"sub-task {agent}"}], max_tokens=2,
            extra_headers={"x-claude-code-session-id": "S", "x-claude-code-agent-id": agent})
        assert raw.headers["x-kvgate-worker"] == home
        assert raw.headers["x-kvgate-route-reason"] == "session_affinity:sticky"
    child = await c.gateway.runtime.store.get("S:agent:a1")  # type: ignore[arg-type]
    assert child is not None and child.home == home


SYSTEM = {"role": "system", "content": "You are a coding agent with tools. " * 30}


async def agent_turns(oc: Any, msgs: list[dict[str, Any]], n: int, tag: str) -> list[tuple[str, str, str]]:
    """``n`` tool-calling turns of a keyless client; (worker, conversation id, source) of each."""
    from tests.helpers import TOOLS

    out = []
    for i in range(n):
        raw = await oc.chat.completions.with_raw_response.create(
            model=MODEL, messages=msgs, tools=TOOLS, extra_body={"sim": {"tool_calls": 1, "reasoning_tokens": 10}})
        m = raw.parse().choices[0].message
        msgs.append(m.model_dump(exclude_none=True))
        msgs.append({"role": "tool", "tool_call_id": m.tool_calls[0].id, "content": f"{tag} result {i}: " + "x" * 60})
        out.append((raw.headers["x-kvgate-worker"], raw.headers["x-kvgate-conversation-id"],
                    raw.headers["x-kvgate-conversation-source"]))
    return out


def compact(msgs: list[dict[str, Any]], keep: int) -> list[dict[str, Any]]:
    """What a harness does when the context fills: the old turns become one summary, the last ``keep``
    messages stay as they were."""
    return [SYSTEM, {"role": "user", "content": "Summary of the work so far: " + "we searched the code. " * 10},
            *msgs[-keep:]]


@pytest.mark.parametrize("store", ["memory", "redis"])
async def test_a_keyless_agent_keeps_its_conversation_across_a_compaction(make_cluster: Any, store: str) -> None:
    import uuid

    extra = {"session_store": "redis", "redis_prefix": f"kvt-{uuid.uuid4().hex[:8]}:"} if store == "redis" else {}
    c = await make_cluster(3, policy="session_affinity", replicas=2 if store == "redis" else 1, **extra)
    first, second = client(c), (openai_client(c.urls[1]) if store == "redis" else client(c))
    a = [SYSTEM, {"role": "user", "content": "task A: fix the failing test in the parser module"}]
    b = [SYSTEM, {"role": "user", "content": "task B: add a flag to the command line tool"}]
    before = await agent_turns(first, a, 3, "A")
    other = await agent_turns(first, b, 2, "B")
    (_, cid, src), = set(before)
    assert src == "derived" and cid not in {x for _, x, _ in other}
    a = compact(a, keep=4)
    after = await agent_turns(second, a, 3, "A")  # on the other replica when the store is shared
    assert [x for _, x, _ in after] == [cid] * 3
    assert [s for _, _, s in after] == ["regrouped"] * 3
    assert {w for w, _, _ in after} == {before[0][0]}
    conv = await c.gateway.runtime.store.get(cid)  # type: ignore[arg-type]
    assert conv is not None and len(conv.turns) == 6
    # The other agent, same system prompt, was never merged into it.
    assert [x for _, x, _ in await agent_turns(first, b, 1, "B")] == [other[0][1]]


def openai_client(url: str) -> Any:
    import openai

    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


async def test_regrouping_off_starts_a_new_conversation(make_cluster: Any) -> None:
    c = await make_cluster(2, policy="session_affinity", regroup_derived=False)
    a = [SYSTEM, {"role": "user", "content": "task A: fix the failing test in the parser module"}]
    before = await agent_turns(client(c), a, 2, "A")
    after = await agent_turns(client(c), compact(a, keep=4), 1, "A")
    assert after[0][1] != before[0][1] and after[0][2] == "derived"
