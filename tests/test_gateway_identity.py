"""The harnesses' own session keys end to end: the openai client sends only what Claude Code, Codex or
OpenCode send, through the gateway to simulated workers."""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import MODEL
from tests.test_gateway import client, metric, run_agent


@pytest.mark.parametrize("header", ["x-claude-code-session-id", "session-id", "x-session-affinity"])
async def test_a_harness_session_header_alone_is_one_conversation(make_cluster: Any, header: str) -> None:
    c = await make_cluster(3, policy="session_affinity")
    oc = client(c)
    turns = await run_agent(oc, None, 4, headers={header: "run-7f3a"})
    assert len({w for w, _, _ in turns}) == 1
    assert all(b > a for (_, _, a), (_, _, b) in zip(turns, turns[1:], strict=False))
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
