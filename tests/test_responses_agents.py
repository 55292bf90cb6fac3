"""The OpenAI Agents SDK (``openai-agents``, its default model is the Responses API) running a tool loop
through kvgate in front of simulated workers."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import httpx
import openai
import pytest

from tests.conftest import MODEL

if TYPE_CHECKING:
    import httpx2  # the openai SDK's own httpx fork

agents = pytest.importorskip("agents")


async def test_agents_sdk_tool_loop(make_cluster: Any) -> None:
    from agents import Agent, ModelSettings, OpenAIResponsesModel, RunConfig, Runner, function_tool

    c = await make_cluster(3, events=True)
    calls: list[str] = []

    @function_tool
    def search(query: str) -> str:
        """Search the code base."""
        calls.append(query)
        return f"found {query} in cache.py " * 20

    sent: list[dict[str, Any]] = []

    async def keep(request: httpx2.Request) -> None:
        sent.append(json.loads(request.content))

    oc = openai.AsyncOpenAI(base_url=c.url + "/v1", api_key="unused", max_retries=0,
                            default_headers={"x-session-id": "agents-sdk-1"},
                            http_client=openai.DefaultAsyncHttpxClient(event_hooks={"request": [keep]}))
    agent = Agent(name="fixer", instructions="You fix bugs. " * 30, tools=[search],
                  model=OpenAIResponsesModel(MODEL, oc), model_settings=ModelSettings(max_tokens=256))
    result = await Runner.run(agent, "find the cache bug", run_config=RunConfig(tracing_disabled=True))
    assert calls and result.final_output
    assert len(result.raw_responses) >= 2
    # A second user turn on the first's items (as a chat UI over the SDK does): four requests in all.
    again = await Runner.run(agent, [*result.to_input_list(), {"role": "user", "content": "and the other one?"}],
                             run_config=RunConfig(tracing_disabled=True))
    assert again.final_output and len(calls) == 2
    # What it sends (docs/protocols.md): include [], strict function tools, the whole input every time.
    print("agents sdk sent:", sent[0].get("include"), [sorted(b) for b in sent],
          [[i.get("type", "message") for i in b["input"]] for b in sent])
    async with httpx.AsyncClient() as h:
        conv = (await h.get(c.url + "/admin/conversations/agents-sdk-1")).json()
    turns = conv["turns"]
    assert len(turns) == len(sent) == 4
    assert len({t["worker"] for t in turns}) == 1
    assert [t["cached_tokens"] for t in turns] == [t["expected_cached_tokens"] for t in turns]
    assert turns[0]["cached_tokens"] == 0 and all(t["cached_tokens"] > 0 for t in turns[1:])
