"""Hostile input at the Messages door: derandomized structure-aware mutations of a valid tool-loop request
(tests/httpfuzz/strategies.py's mutator and wire encodings) and hand-written edge cases (10,000 messages, deep
nesting, unknown blocks, a tool result without its call). Every refusal is a 4xx in Anthropic's error shape
that names the problem (never the proxy's catch-all), never a 5xx, and leaves no conversation behind."""

from __future__ import annotations

import copy
from collections import Counter
from typing import Any

import httpx
from hypothesis import strategies as st

from kvgate.fronts.messages.signing import Signer
from kvgate.router.types import ConversationId
from tests.conftest import MODEL, Cluster
from tests.httpfuzz.strategies import drawn_bodies, nest

N_MUTATED = 400
THOUGHT = "I should look at the failing test first."
BASE: dict[str, Any] = {
    "model": MODEL, "max_tokens": 2048, "system": [{"type": "text", "text": "You are an agent.",
                                                 "cache_control": {"type": "ephemeral"}}],
    "tools": [{"name": "search", "description": "search", "input_schema": {"type": "object"}}],
    "tool_choice": {"type": "auto"}, "thinking": {"type": "enabled", "budget_tokens": 1024},
    "stop_sequences": ["STOP"], "metadata": {"user_id": "u"},
    "messages": [
        {"role": "user", "content": "fix the test"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": THOUGHT, "signature": Signer(None).sign(THOUGHT)},
            {"type": "text", "text": "Searching."},
            {"type": "tool_use", "id": "toolu_1", "name": "search", "input": {"q": "test"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "found"}],
             "is_error": False},
            {"type": "text", "text": "go on"}]}],
}
BASES = st.sampled_from([BASE, {**BASE, "max_tokens": 8, "thinking": {"type": "disabled"}}, {**BASE, "stream": True}])

ERROR_TYPES = {"invalid_request_error", "authentication_error", "permission_error", "not_found_error",
               "request_too_large", "rate_limit_error", "api_error", "overloaded_error"}


def _edge_cases() -> list[Any]:
    def with_msgs(msgs: list[Any], **kw: Any) -> dict[str, Any]:
        return {**copy.deepcopy(BASE), "messages": msgs, **kw}

    u = BASE["messages"][0]
    a, r = BASE["messages"][1], BASE["messages"][2]
    return [
        with_msgs([u, a, r] * 3334),  # 10,002 messages, tool ids repeated
        with_msgs([{"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i}"} for i in range(10_001)]),
        with_msgs([{"role": "user", "content": [{"type": "text", "text": "x"}] * 10_000}]),
        with_msgs([u, {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "search",
                                                          "input": nest(500, True)}]},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "ok"}]}]),
        with_msgs([{"role": "user", "content": nest(400, False)}]),
        with_msgs([u, {"role": "assistant", "content": [{"type": "tool_use", "id": f"t{k}", "name": "search",
                                                          "input": {}} for k in range(3_000)]},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"t{k}", "content": "r"}
                                                for k in range(3_000)]}]),
        with_msgs([{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "nope", "content": "x"}]}]),
        with_msgs([u, a, {"role": "user", "content": "no result"}]),
        with_msgs([u, {"role": "assistant", "content": [{"type": "tool_use", "id": "d", "name": "s", "input": {}},
                                                          {"type": "tool_use", "id": "d", "name": "s", "input": {}}]},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "d", "content": "x"}]}]),
        with_msgs([{"role": "user", "content": [{"type": "hologram"}]}]),
        with_msgs([{"role": "user", "content": [{"type": "image", "source": {}}]}]),
        with_msgs([{"role": "user", "content": [{"type": "document", "source": {}}]}]),
        with_msgs([{"role": "system", "content": "x"}]),
        with_msgs([u, {"role": "assistant", "content": "prefill"}]),
        with_msgs([u, {"role": "assistant", "content": [{"type": "thinking", "thinking": "x"}]}, u]),
        with_msgs([u, {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "opaque"},
                                                          {"type": "text", "text": "ok"}]}, u]),
        with_msgs([]),
        {**BASE, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
        {**BASE, "tools": [{"name": "t"}]},
        {**BASE, "tool_choice": {"type": "tool"}},
        {**BASE, "thinking": {"type": "enabled", "budget_tokens": 100}},
        {**BASE, "thinking": {"type": "enabled", "budget_tokens": 4096}, "max_tokens": 10},
        {**BASE, "system": [{"type": "image"}]},
        {**BASE, "n": 3}, {**BASE, "stream_options": {}}, {**BASE, "container": "c"},
        {**BASE, "output_config": {"format": {"type": "json_schema"}}}, {**BASE, "model": "nope"},
        {**BASE, "max_tokens": 0}, {**BASE, "max_tokens": True}, {**BASE, "stream": "yes"},
    ]


def _check(r: httpx.Response, tally: Counter[str], findings: list[str], what: str) -> bool:
    """Whether the request was refused (after checking the answer's shape)."""
    if r.status_code >= 500:
        findings.append(f"{r.status_code}: {r.text[:200]} <- {what}")
        return True
    if r.status_code >= 400:
        try:
            body = r.json()
        except ValueError:
            body = None
        err = body.get("error") if isinstance(body, dict) else None
        if not (isinstance(body, dict) and body.get("type") == "error" and isinstance(err, dict)
                and err.get("type") in ERROR_TYPES and isinstance(err.get("message"), str)):
            findings.append(f"{r.status_code} not in Anthropic's shape: {r.text[:200]} <- {what}")
        elif err["message"].startswith("The request could not be processed"):
            findings.append(f"reached the catch-all: {err['message'][:200]} <- {what}")
        tally[f"{r.status_code} {err.get('type') if isinstance(err, dict) else '?'}"] += 1
        return True
    tally[f"{r.status_code}"] += 1
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        last = [ln for ln in r.text.splitlines() if ln.startswith("event: ")][-1:]
        if last != ["event: message_stop"]:
            findings.append(f"stream did not end with message_stop: {r.text[-200:]} <- {what}")
    elif r.request.url.path.endswith("/count_tokens"):
        if not isinstance(r.json().get("input_tokens"), int):
            findings.append(f"count_tokens without a count: {r.text[:200]} <- {what}")
    elif r.json().get("type") != "message":
        findings.append(f"200 without a message: {r.text[:200]} <- {what}")
    return False


async def test_fuzz_messages(make_cluster: Any) -> None:
    c: Cluster = await make_cluster(1)
    bodies = drawn_bodies(_edge_cases(), BASES, N_MUTATED)
    tally: Counter[str] = Counter()
    findings: list[str] = []
    refused: list[str] = []
    async with httpx.AsyncClient(base_url=c.url, timeout=60) as h:
        for i, body in enumerate(bodies):
            path = "/v1/messages/count_tokens" if i % 7 == 6 else "/v1/messages"
            cid = f"fzm-{i}"
            r = await h.post(path, content=body, headers={"content-type": "application/json",
                                                          "x-conversation-id": cid})
            if _check(r, tally, findings, f"{path} {body[:200]!r}") and path == "/v1/messages":
                refused.append(cid)
        ok = await h.post("/v1/messages", json=BASE)
    assert not findings, "\n".join(findings[:10])
    assert ok.status_code == 200, ok.text
    stored = [cid for cid in refused if await c.gateway.store.get(ConversationId(cid)) is not None]
    assert not stored, f"refused requests left conversations: {stored[:5]}"
    # Both sides were exercised: most mutations are refused, yet some mutated requests were served.
    assert sum(v for k, v in tally.items() if k.startswith("4")) > 100 and tally["200"] > 20, tally
    print(f"messages fuzz: {len(bodies)} requests, {dict(sorted(tally.items()))}")
