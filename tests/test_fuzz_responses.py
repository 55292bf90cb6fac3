"""Hostile input at the Responses door: derandomized structure-aware mutations of a valid tool-loop request
(tests/httpfuzz/strategies.py's mutator and wire encodings) and hand-written edge cases (10,000 items, deep nesting,
unknown item and part types, encrypted reasoning, a tool output without its call, built-in tools). Every
refusal is a 4xx in OpenAI's error shape that names the problem (never the proxy's catch-all), never a
5xx, and leaves no conversation and no stored response behind; every 200 is a response (or a stream that
ends with response.completed / response.incomplete)."""

from __future__ import annotations

import copy
import json
from collections import Counter
from typing import Any

import httpx
from hypothesis import strategies as st

from kvgate.router.types import ConversationId
from tests.conftest import MODEL, Cluster
from tests.httpfuzz.strategies import drawn_bodies, nest

N_MUTATED = 400
REASONING = {"type": "reasoning", "id": "rs_1", "summary": [],
             "content": [{"type": "reasoning_text", "text": "look at the test first"}]}
CALL = {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "search", "arguments": "{\"q\": 1}"}
OUTPUT = {"type": "function_call_output", "call_id": "call_1", "output": "found it"}
BASE: dict[str, Any] = {
    "model": MODEL, "instructions": "You are an agent.", "max_output_tokens": 64, "store": True,
    "tools": [{"type": "function", "name": "search", "description": "search", "parameters": {"type": "object"}}],
    "tool_choice": "auto", "reasoning": {"effort": "low"}, "metadata": {"k": "v"}, "temperature": 0.5,
    "input": [{"role": "user", "content": [{"type": "input_text", "text": "fix the test"}]}, REASONING,
              {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Searching."}]},
              CALL, OUTPUT],
}
BASES = st.sampled_from([BASE, {**BASE, "input": "hello", "store": False}, {**BASE, "stream": True}])


def _edge_cases() -> list[Any]:
    def with_input(items: Any, **kw: Any) -> dict[str, Any]:
        return {**copy.deepcopy(BASE), "input": items, **kw}

    u = BASE["input"][0]
    return [
        with_input([u] * 10_000),
        with_input([u, REASONING, CALL, OUTPUT] * 2_500),
        with_input([{"role": "user", "content": [{"type": "input_text", "text": "x"}] * 10_000}]),
        with_input([u, {**CALL, "arguments": json.dumps(nest(400, True))}, OUTPUT]),
        with_input([{"role": "user", "content": nest(400, False)}]),
        with_input([u, {**CALL, "arguments": nest(50, True)}]),
        with_input([OUTPUT]),  # a tool output without its call
        with_input([u, {**OUTPUT, "call_id": "call_other"}]),
        with_input([u, {"type": "hologram"}]),
        with_input([u, {"type": "item_reference", "id": "msg_1"}]),
        with_input([u, {"type": "web_search_call", "id": "ws_1", "status": "completed"}]),
        with_input([{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]),
        with_input([{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]),
        with_input([{"role": "wizard", "content": "x"}]),
        with_input([u, {**REASONING, "encrypted_content": "gAAAAB..."}]),
        with_input([u, {**REASONING, "content": [{"type": "summary_text", "text": "x"}]}]),
        with_input([u, {**REASONING, "content": None, "summary": "x"}]),
        with_input([]), with_input(None), with_input(42), with_input([None]), with_input(["x"]),
        {**BASE, "tools": [{"type": "web_search"}]}, {**BASE, "tools": [{"type": "function"}]},
        {**BASE, "tools": [{"type": "mcp", "server_label": "x"}]}, {**BASE, "tools": "all"},
        {**BASE, "tool_choice": {"type": "file_search"}}, {**BASE, "tool_choice": 7},
        {**BASE, "tools": [], "tool_choice": "required"},
        {**BASE, "background": True}, {**BASE, "conversation": "conv_1"}, {**BASE, "prompt": {"id": "p"}},
        {**BASE, "text": {"format": {"type": "json_schema"}}}, {**BASE, "text": "json"},
        {**BASE, "previous_response_id": "resp_nope"}, {**BASE, "previous_response_id": ""},
        {**BASE, "previous_response_id": 5}, {**BASE, "store": "yes"}, {**BASE, "stream": "yes"},
        {**BASE, "max_output_tokens": 0}, {**BASE, "max_output_tokens": True}, {**BASE, "model": "nope"},
        {**BASE, "metadata": {"k": 1}}, {**BASE, "metadata": {f"k{i}": "v" for i in range(17)}},
        {**BASE, "reasoning": "high"}, {**BASE, "instructions": ["x"]},
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
        if not (isinstance(err, dict) and isinstance(err.get("message"), str) and isinstance(err.get("type"), str)
                and set(err) == {"message", "type", "param", "code"}):
            findings.append(f"{r.status_code} not in OpenAI's shape: {r.text[:200]} <- {what}")
        elif err["message"].startswith("The request could not be processed"):
            findings.append(f"reached the catch-all: {err['message'][:200]} <- {what}")
        tally[f"{r.status_code} {err.get('type') if isinstance(err, dict) else '?'}"] += 1
        return True
    tally[f"{r.status_code}"] += 1
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        last = [ln for ln in r.text.splitlines() if ln.startswith("event: ")][-1:]
        if last not in (["event: response.completed"], ["event: response.incomplete"]):
            findings.append(f"stream did not end with response.completed: {r.text[-200:]} <- {what}")
    elif r.json().get("object") != "response" or not r.json().get("id", "").startswith("resp_"):
        findings.append(f"200 without a response: {r.text[:200]} <- {what}")
    return False


async def test_fuzz_responses(make_cluster: Any) -> None:
    c: Cluster = await make_cluster(1)
    bodies = drawn_bodies(_edge_cases(), BASES, N_MUTATED)
    tally: Counter[str] = Counter()
    findings: list[str] = []
    refused: list[str] = []
    async with httpx.AsyncClient(base_url=c.url, timeout=60) as h:
        for i, body in enumerate(bodies):
            cid = f"fzr-{i}"
            r = await h.post("/v1/responses", content=body, headers={"content-type": "application/json",
                                                                     "x-conversation-id": cid})
            if _check(r, tally, findings, f"{body[:200]!r}"):
                refused.append(cid)
        ok = await h.post("/v1/responses", json=BASE)
        assert ok.status_code == 200, ok.text
        assert (await h.get(f"/v1/responses/{ok.json()['id']}")).status_code == 200
        for path in ("/v1/responses/x%00y", "/v1/responses/" + "r" * 5000, "/v1/responses/resp_x/input_items"
                     "?limit=0", "/v1/responses/resp_x/input_items?order=up", f"/v1/responses/{ok.json()['id']}"
                     "/input_items?limit=abc", f"/v1/responses/{ok.json()['id']}?stream=true"):
            _check(await h.get(path), tally, findings, path)
    assert not findings, "\n".join(findings[:10])
    stored = [cid for cid in refused if await c.gateway.store.get(ConversationId(cid)) is not None]
    assert not stored, f"refused requests left conversations: {stored[:5]}"
    # Both sides were exercised: most mutations are refused, yet some mutated requests were served.
    assert sum(v for k, v in tally.items() if k.startswith("4")) > 100 and tally["200"] > 20, tally
    print(f"responses fuzz: {len(bodies)} requests, {dict(sorted(tally.items()))}")
