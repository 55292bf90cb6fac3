"""Agent frameworks run unchanged through kvgate in front of simulated workers: the OpenAI Agents SDK
with ``OpenAIChatCompletionsModel`` (the chat door) and with its default model (``OpenAIResponsesModel``,
the Responses door), and LangGraph's ReAct agent over ``langchain-openai``'s ``ChatOpenAI``, on Chat
Completions and with ``use_responses_api=True``.

Neither sends a session key, so kvgate names the conversation itself (the derived key). The simulator's
default script drives the loop (docs/simulator.md): one call of the first tool after a user message, a
plain answer after a tool result, so every user turn is a two-request tool chain. What is checked per
agent, from the conversation record and what the client itself saw: one worker, one conversation,
expected == reported cached tokens on every request, cached tokens growing request after request, and
every token of history that was not reused named with a cause."""

from __future__ import annotations

import itertools
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx
import openai
import pytest

from tests.conftest import MODEL, Cluster
from tests.helpers import eventually

if TYPE_CHECKING:
    import httpx2  # the openai SDK's own httpx fork, which both frameworks' clients are built on

SYSTEM = "You fix bugs in a Python code base. Search before you answer. " * 20
TASKS = ["find the cache bug in the store module", "and the one in the router?", "write the fix up"]


@dataclass
class Seen:
    """What one client sent and kvgate told it, from its response headers (read by an httpx hook: the
    client's own requests are not touched)."""

    headers: list[httpx2.Headers] = field(default_factory=list)
    bodies: list[dict[str, Any]] = field(default_factory=list)

    async def __call__(self, response: httpx2.Response) -> None:
        if response.request.url.path.endswith(("/chat/completions", "/responses")):
            self.headers.append(response.headers)
            self.bodies.append(json.loads(response.request.content))

    def client(self) -> httpx2.AsyncClient:
        return openai.DefaultAsyncHttpxClient(event_hooks={"response": [self]}, timeout=60)


async def record_of(c: Cluster, seen: Seen) -> dict[str, Any]:
    convs = {h["x-kvgate-conversation-id"] for h in seen.headers}
    assert len(convs) == 1, convs  # one agent, one conversation, without a key of its own
    assert {h["x-kvgate-conversation-source"] for h in seen.headers} <= {"derived", "regrouped", "previous_response_id"}
    async with httpx.AsyncClient() as h:
        r = await h.get(f"{c.url}/admin/conversations/{convs.pop()}")
    assert r.status_code == 200, r.text
    rec: dict[str, Any] = r.json()
    return rec


def check_agent(rec: dict[str, Any], seen: Seen, client_cached: list[int], tool_chain: list[bool]) -> None:
    """``tool_chain[i]``: request i follows a tool result (not a new user message)."""
    turns = rec["turns"]
    print("worker / prompt / cached / expected / lost (cause, detail):",
          [(t["worker"][-5:], t["prompt_tokens"], t["cached_tokens"], t["expected_cached_tokens"],
            t["lost_tokens"], t["loss_cause"], t["loss_detail"]) for t in turns],
          "history:", [h.get("x-kvgate-history") for h in seen.headers])
    assert len(turns) == len(seen.headers) == len(client_cached) == len(tool_chain)
    assert len({t["worker"] for t in turns}) == 1
    assert {h["x-kvgate-worker"] for h in seen.headers} == {turns[0]["worker"]}
    # kvgate's expectation (header and record) == the engine's report (record) == what the client read.
    assert [int(h["x-kvgate-expected-cached-tokens"]) for h in seen.headers] \
        == [t["expected_cached_tokens"] for t in turns] == [t["cached_tokens"] for t in turns] == client_cached
    cached = [t["cached_tokens"] for t in turns]
    assert cached[0] == 0 and all(b > a for (a, b), in_chain in zip(itertools.pairwise(cached), tool_chain[1:],
                                                                     strict=True) if in_chain), cached
    user_turn = 0
    for prev, t, in_chain in zip(turns[:-1], turns[1:], tool_chain[1:], strict=True):
        # Nothing rerouted or evicted (a reply ending on a block boundary is partial-block loss: its last
        # token's KV is never computed, tests/test_responses.py).
        assert t["cache_lost_tokens"] == 0, (prev, t)
        if t["lost_tokens"]:
            assert t["loss_cause"], t  # every lost token is named
        if in_chain:
            # Inside a tool chain the prompt extends the last prompt and the engine's reply: only the new
            # tokens and the partial last block are prefilled, whatever the framework did to the echoed
            # assistant message (kvgate restores its exact form).
            new = t["prompt_tokens"] - prev["prompt_tokens"] - prev["completion_tokens"]
            assert t["loss_cause"] in (None, "block_alignment") and t["lost_tokens"] < 128, t
            # Prefilled: the new tokens, the lost ones and the reply's last token (never computed).
            assert t["prompt_tokens"] - t["cached_tokens"] <= new + t["lost_tokens"] + 1, (t, new)
        else:
            # A new user turn: the tiny model's Qwen3 template drops the earlier turn's reasoning, so the
            # prompt diverges inside the previous turn's first assistant message (messages: the system,
            # then per turn user, tool call, tool result, answer), and the cause is named there.
            user_turn += 1
            assert t["loss_cause"] == "reasoning_dropped", t
            assert t["loss_detail"] == f"message {4 * user_turn - 2} (template)", t
            assert 0 < t["cached_tokens"] and t["lost_tokens"] > 0, t
    reuse = [h.get("x-kvgate-prefix-reuse", "") for h in seen.headers[1:]]
    assert all(f"cause={t['loss_cause'] or 'none'}" in r for r, t in zip(reuse, turns[1:], strict=True)), reuse


def restored(h: httpx2.Headers) -> int:
    return int(h["x-kvgate-history"].split("restored=")[1].split(";")[0])


async def precise(make_cluster: Callable[..., Awaitable[Cluster]], n: int = 3) -> Cluster:
    c = await make_cluster(n, events=True)  # precise mode: kvgate's expectation is exact
    await eventually(lambda: len(c.gateway.prefix.events.workers()) == n)
    return c


# -- the OpenAI Agents SDK ------------------------------------------------------------------------------
agents = pytest.importorskip("agents")


@pytest.mark.parametrize("stream", [False, True], ids=["run", "run_streamed"])
# "chained": the default model on previous_response_id (auto_previous_response_id): each request sends only
# what is new, and kvgate's stored responses carry the history.
@pytest.mark.parametrize("api", ["chat", "responses", "chained"])
async def test_agents_sdk_tool_loop(make_cluster: Any, api: str, stream: bool) -> None:
    import agents as sdk

    c = await precise(make_cluster)
    calls: list[str] = []

    @sdk.function_tool
    def search(query: str) -> str:
        """Search the code base."""
        calls.append(query)
        return f"found {query!r} in store.py line {len(calls)} " * 15

    seen = Seen()
    oc = openai.AsyncOpenAI(base_url=c.url + "/v1", api_key="unused", max_retries=0, http_client=seen.client())
    model = sdk.OpenAIChatCompletionsModel(MODEL, oc) if api == "chat" else sdk.OpenAIResponsesModel(MODEL, oc)
    agent = sdk.Agent(name="fixer", instructions=SYSTEM, tools=[search], model=model,
                      # usage in the stream: the SDK asks for it only when told to
                      model_settings=sdk.ModelSettings(max_tokens=256, include_usage=stream or None))
    cfg = sdk.RunConfig(tracing_disabled=True)
    items: list[Any] = []
    client_cached: list[int] = []
    chain: dict[str, Any] = {}
    for task in TASKS:
        items.append({"role": "user", "content": task})
        if api == "chained":
            chain = dict(auto_previous_response_id=True, previous_response_id=chain.get("previous_response_id"))
            items = items[-1:]
        if stream:
            res: Any = sdk.Runner.run_streamed(agent, items, run_config=cfg, **chain)
            async for _ in res.stream_events():
                pass
        else:
            res = await sdk.Runner.run(agent, items, run_config=cfg, **chain)
        assert res.final_output
        client_cached += [r.usage.input_tokens_details.cached_tokens for r in res.raw_responses]
        items = res.to_input_list()
        if api == "chained":
            chain["previous_response_id"] = res.last_response_id
    assert len(calls) == len(TASKS)
    check_agent(await record_of(c, seen), seen, client_cached, [False, True] * len(TASKS))
    # The SDK replays the engine's reasoning itself (its chat converter keeps the `reasoning` field; its
    # Responses items keep reasoning_text content): kvgate has nothing to restore.
    assert [restored(h) for h in seen.headers] == [0] * len(seen.headers)
    if api == "chained":  # what it sent after the first request: only the new items, on the last response
        assert all(b.get("previous_response_id") for b in seen.bodies[1:]), seen.bodies
        assert all(len(b["input"]) == 1 for b in seen.bodies[1:])
    await oc.close()


# -- LangGraph's ReAct agent over langchain-openai --------------------------------------------------
# The issue names langgraph.prebuilt's create_react_agent: LangGraph 1.x still ships it, deprecated in
# favour of langchain.agents.create_agent (another package), and warns.
@pytest.mark.filterwarnings("ignore:create_react_agent has been moved")
@pytest.mark.parametrize("streaming", [False, True], ids=["invoke", "streaming"])
@pytest.mark.parametrize("api", ["chat", "responses"])
async def test_langgraph_react_agent_tool_loop(make_cluster: Any, api: str, streaming: bool) -> None:
    pytest.importorskip("langgraph")
    from langchain_core.messages import AIMessage, HumanMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.prebuilt import create_react_agent

    c = await precise(make_cluster)
    calls: list[str] = []

    @tool
    def search(query: str) -> str:
        """Search the code base."""
        calls.append(query)
        return f"found {query!r} in store.py line {len(calls)} " * 15

    seen = Seen()
    http = seen.client()
    llm = ChatOpenAI(model=MODEL, base_url=c.url + "/v1", api_key="unused", max_retries=0,
                     http_async_client=http, streaming=streaming, stream_usage=True,
                     use_responses_api=api == "responses")
    agent = create_react_agent(llm, [search], prompt=SYSTEM)
    messages: list[Any] = []
    for task in TASKS:
        out = await agent.ainvoke({"messages": [*messages, HumanMessage(task)]})
        messages = out["messages"]
        assert isinstance(messages[-1], AIMessage) and messages[-1].content and not messages[-1].tool_calls
    assert len(calls) == len(TASKS)
    replies = [m for m in messages if isinstance(m, AIMessage)]
    client_cached = []
    for m in replies:
        assert m.usage_metadata is not None and "input_token_details" in m.usage_metadata
        client_cached.append(m.usage_metadata["input_token_details"].get("cache_read", -1))
    check_agent(await record_of(c, seen), seen, client_cached, [False, True] * len(TASKS))
    # ChatOpenAI on Chat Completions sends an AIMessage back without the engine's reasoning, and on the
    # Responses API streamed it keeps no reasoning text either (its stream reader takes reasoning
    # summaries, kvgate streams reasoning_text as vLLM does): kvgate restores every earlier reply's
    # reasoning from the record (one more each request), which is why the chain still matches. Unstreamed
    # Responses items carry the reasoning_text back: nothing to restore.
    restores = api == "chat" or streaming
    assert [restored(h) for h in seen.headers] == [i if restores else 0 for i in range(len(seen.headers))]
    await http.aclose()
