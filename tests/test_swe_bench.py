"""The SWE-agent replay's conversion of trajectories and the messages each client sends."""

from __future__ import annotations

import json

from kvgate.bench.data import SWE_TRAJECTORIES
from kvgate.bench.swe import CLIENTS, client_messages, load_trajectories

FOLDER = SWE_TRAJECTORIES


def replies(n: int) -> list[dict[str, object]]:
    return [{"role": "assistant", "content": "", "reasoning": f"thought {i}",
             "tool_calls": [{"id": f"c{i}", "type": "function",
                             "function": {"name": "bash", "arguments": json.dumps({"command": f"ls {i}"})}}]}
            for i in range(n)]


def test_all_22_trajectories_convert() -> None:
    ts = load_trajectories(FOLDER)
    assert len(ts) == 22
    assert all(t.steps and t.system and t.task for t in ts)
    assert {s.observation_role for t in ts for s in t.steps} == {"tool", "user"}


def test_clients_send_what_they_claim() -> None:
    t = next(t for t in load_trajectories(FOLDER) if len(t.steps) >= 6)
    r = replies(6)
    keep = client_messages(CLIENTS[0], t, 5, r)
    assert len(keep) == 2 + 2 * 5 and keep[2] == r[0]
    reser = client_messages(CLIENTS[2], t, 5, r)
    assert reser[2]["tool_calls"][0]["function"]["arguments"] == '{"command":"ls 0"}'
    assert reser[2]["reasoning_content"] == "thought 0" and "reasoning" not in reser[2]
    merged = client_messages(CLIENTS[3], t, 5, r)
    assert len(merged) == 2 and t.steps[4].action in merged[1]["content"]
    summ = client_messages(CLIENTS[4], t, 5, r)
    assert summ[2]["content"].startswith("Summary of the work so far") and len(summ) == 3 + 2 * 1
