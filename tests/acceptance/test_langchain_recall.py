"""End to end: a LangChain agent recalls, through CompactdMiddleware's own tools, a detail that a
background compaction took off its surface.

The agent (``create_agent``, a checkpointer, ChatOpenAI over HTTP) runs a long tool-using session
whose second tool result holds the detail; a real Celery worker, sent queued runs by the
session's own pressure signals, compacts it on PostgreSQL and Redis while the agent works. Then
the agent is asked about the detail: the scripted model (the fake provider's ``agent-gpt``)
calls ``history_search``, then ``history_read`` on the checkpoint of the hit it was given, and
answers quoting what the read returned. ``fake-gpt`` writes the summaries, which name paths,
exceptions and tickets but not the detail.
"""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

import pytest
from langchain.agents import create_agent
from langchain_core.messages import AIMessage, ToolMessage
from langchain_core.tools import tool
from langgraph.checkpoint.memory import InMemorySaver

from compactd.scheduler.langchain import CompactdMiddleware
from compactd.storage.kinds import RunCause, RunStatus
from compactd.storage.records import RunRecord
from compactd.storage.store import Store
from compactd.worker.compaction.render import LANGCHAIN_PREFIX, render_surface
from compactd.worker.settings import load_config
from tests.support.chat_models import fake_chat_openai
from tests.support.fake_provider import Behaviour
from tests.support.langchain_agents import assert_tool_pairs_whole

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.redis]

AGENT_MODEL = "agent-gpt"
SUMMARY_MODEL = "fake-gpt"
SESSION = "agent-recall"
STEPS = 24
DETAIL = "ord_7f3c9a1e"
PLANTED = f"refund check: the refund for order {DETAIL} was issued twice (amount 41.90 EUR)"
QUERY = "issued twice"
POLICY = {"trigger": [{"type": "tokens", "value": 6000}],
          "keep": {"type": "messages", "value": 6}, "model_name": SUMMARY_MODEL,
          "trim_tokens_to_summarize": 100_000}


def test_the_agent_recalls_a_detail_the_background_compaction_dropped(
        make_stack, fake) -> None:  # type: ignore[no-untyped-def]
    stack = make_stack(summarization=POLICY)
    fake.script(Behaviour(model=SUMMARY_MODEL, latency_s=0.2, times=-1),
                Behaviour(model=AGENT_MODEL, output="tool_calls", times=STEPS),
                Behaviour(model=AGENT_MODEL, output="text", text="audit done"))
    stack.start_worker("w1", concurrency=2)

    calls = iter(range(1, 10**6))

    @tool
    def lookup() -> str:
        """Look up the next refund record."""
        n = next(calls)
        planted = PLANTED if n == 2 else f"refund {n}: nothing unusual"
        return f"record {n} of the ledger\n{planted}\n" + "ledger line, settled; " * 80

    middleware = CompactdMiddleware(SESSION, config=load_config(env=stack.env))
    model = fake_chat_openai(fake.openai_base_url, AGENT_MODEL, max_retries=0)
    agent = create_agent(model, tools=[lookup], system_prompt="You audit refunds.",
                         middleware=[middleware], checkpointer=InMemorySaver())
    thread = {"configurable": {"thread_id": SESSION}, "recursion_limit": 4 * STEPS}

    async def surface_text(store: Store) -> str:
        return json.dumps(render_surface((await store.read_surface(SESSION)).nodes))

    async def run() -> tuple[list[Any], list[RunRecord], int, int]:
        store = Store.from_url(stack.database_url)
        try:
            await agent.ainvoke(
                {"messages": [{"role": "user", "content": "Audit the refund ledger."}]}, thread)
            # The worker compacts in the background: wait until the detail is off the surface.
            deadline = asyncio.get_running_loop().time() + 60
            while DETAIL in await surface_text(store):
                assert asyncio.get_running_loop().time() < deadline, "never compacted"
                await asyncio.sleep(0.2)
            fake.script(
                Behaviour(model=AGENT_MODEL, output="tool_calls",
                          tool_calls=[{"name": "history_search",
                                       "arguments": {"query": QUERY}}]),
                Behaviour(model=AGENT_MODEL, output="tool_calls",
                          tool_calls=[{"name": "history_read", "arguments": {
                              "checkpoint": {"$from_result": "hits.0.checkpoint"}}}]),
                Behaviour(model=AGENT_MODEL, output="text",
                          text="The order refunded twice is {quote}.",
                          quote=r"ord_[0-9a-f]{8}"))
            asked = len(fake.requests_for(model=AGENT_MODEL))
            out = await agent.ainvoke(
                {"messages": [{"role": "user", "content": "Which order was refunded twice?"}]},
                thread)
            events = await store.read_events(SESSION, kinds=["message"])
            planted = next(e.seq for e in events if PLANTED in str(e.payload.get("content")))
            return (list(out["messages"]), await store.session_runs(SESSION, limit=50),
                    planted, asked)
        finally:
            await store.close()

    try:
        state, runs, planted_seq, asked = asyncio.run(run())
    finally:
        middleware.close()

    # The worker compacted, on runs the pressure signals queued: none ran in this process
    # (owners are host:pid), none was manual.
    committed = [r for r in runs if r.status == RunStatus.COMMITTED]
    assert committed and all(r.trigger == RunCause.PRESSURE for r in committed), runs
    assert all(r.owner and not r.owner.endswith(f":{os.getpid()}") for r in committed), runs

    # What the model was sent when asked: a checkpoint in place of the history, the detail gone.
    question = fake.requests_for(model=AGENT_MODEL)[asked:]
    assert len(question) == 3
    assert question[0].body is not None
    first = json.dumps(question[0].body["messages"])
    assert LANGCHAIN_PREFIX in first and DETAIL not in first

    # The two tool calls, with the right arguments; the results hold the exact value.
    recall = [c for m in state if isinstance(m, AIMessage) for c in m.tool_calls
              if c["name"].startswith("history_")]
    results = [m for m in state if isinstance(m, ToolMessage) and m.name in (
        "history_search", "history_read")]
    assert [c["name"] for c in recall] == ["history_search", "history_read"]
    assert [r.status for r in results] == ["success", "success"]
    found = json.loads(str(results[0].content))
    hit = found["hits"][0]
    assert hit["exact"] and hit["seq"] == planted_seq and DETAIL in hit["snippet"]
    assert recall[0]["args"] == {"query": QUERY}
    assert recall[1]["args"] == {"checkpoint": hit["checkpoint"]}
    assert PLANTED in str(results[1].content)
    assert f"[seq {planted_seq} tool" in str(results[1].content)
    # ... and the final answer holds it.
    assert state[-1].content == f"The order refunded twice is {DETAIL}."

    # The tool results reached the model at the tail, as ordinary tool messages.
    for request in question:
        assert request.body is not None
        assert_tool_pairs_whole(request.body["messages"])
    assert question[2].body is not None
    assert question[2].body["messages"][-1]["role"] == "tool"
    assert PLANTED in question[2].body["messages"][-1]["content"]

    # The log replays to the surface, recall results and all.
    assert "1/1 sessions verified" in stack.cli("verify", "--all").stdout
    assert stack.cli("verify", SESSION).returncode == 0
