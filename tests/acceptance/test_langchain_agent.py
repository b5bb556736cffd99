"""A LangChain agent with CompactdMiddleware runs a 100-step tool-using conversation while a real
Celery worker compacts its session in the background.

The fake provider plays both models: ``agent-gpt`` (the agent's chat model, scripted to call a
tool 100 times, then answer) and ``fake-gpt`` (the summarizer, 2 s per answer). Timing
middlewares around CompactdMiddleware measure what it adds to each step.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from langchain.agents import create_agent
from langchain.agents.middleware import AgentMiddleware
from langchain.agents.middleware.types import ModelRequest, ModelResponse
from langchain_core.tools import tool
from langgraph.checkpoint.memory import InMemorySaver

from compactd.scheduler.langchain import CompactdMiddleware
from compactd.storage.store import Store
from compactd.worker.compaction.render import LANGCHAIN_PREFIX
from compactd.worker.settings import load_config
from tests.support.chat_models import fake_chat_openai
from tests.support.fake_provider import Behaviour
from tests.support.langchain_agents import assert_tool_pairs_whole

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.redis]

AGENT_MODEL = "agent-gpt"
SUMMARY_MODEL = "fake-gpt"
STEPS = 100
SUMMARY_LATENCY_S = 2.0
TOOL_S = 0.08  # a tool takes a little while, as real ones do
# One summarizer call per compaction (the default input budget would chunk a range this size
# into several 2 s calls, and the agent would outrun them).
POLICY = {"trigger": [{"type": "tokens", "value": 8000}],
          "keep": {"type": "messages", "value": 10}, "model_name": SUMMARY_MODEL,
          "trim_tokens_to_summarize": 100_000}


class Stopwatch(AgentMiddleware):
    """Times each model call as seen from where it sits in the middleware stack."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self._name = name
        self.seconds: list[float] = []

    @property
    def name(self) -> str:
        return self._name

    async def awrap_model_call(
            self, request: ModelRequest[Any],
            handler: Callable[[ModelRequest[Any]], Awaitable[ModelResponse[Any]]]) -> Any:
        started = time.perf_counter()
        try:
            return await handler(request)
        finally:
            self.seconds.append(time.perf_counter() - started)


_calls = iter(range(1, 10**6))


@tool
def lookup() -> str:
    """Look something up."""
    time.sleep(TOOL_S)
    n = next(_calls)
    return f"lookup {n}: src/module_{n}.py line {n * 7}: " + "value computed here; " * 90


@pytest.mark.timed
def test_a_100_step_agent_is_compacted_in_the_background_without_waiting(
        make_stack, fake) -> None:  # type: ignore[no-untyped-def]
    stack = make_stack(summarization=POLICY)
    fake.script(Behaviour(model=SUMMARY_MODEL, latency_s=SUMMARY_LATENCY_S, times=-1),
                Behaviour(model=AGENT_MODEL, output="tool_calls", times=STEPS),
                Behaviour(model=AGENT_MODEL, output="text", text="all done"))
    stack.start_worker("w1", concurrency=4)

    outer, inner = Stopwatch("outer"), Stopwatch("inner")
    compactd = CompactdMiddleware("agent-1", config=load_config(env=stack.env))
    model = fake_chat_openai(fake.openai_base_url, AGENT_MODEL, max_retries=0)
    agent = create_agent(model, tools=[lookup], system_prompt="You are a careful agent.",
                         middleware=[outer, compactd, inner], checkpointer=InMemorySaver())
    try:
        out = asyncio.run(agent.ainvoke(
            {"messages": [{"role": "user", "content": "Audit every module."}]},
            {"configurable": {"thread_id": "agent-1"}, "recursion_limit": 4 * STEPS}))
    finally:
        compactd.close()

    state = out["messages"]
    assert state[-1].content == "all done" and len(state) == 1 + 2 * STEPS + 1

    agent_calls = fake.requests_for(model=AGENT_MODEL)
    summaries = [r for r in fake.requests_for(model=SUMMARY_MODEL) if r.status == 200]
    assert len(agent_calls) == STEPS + 1
    assert summaries, "the worker never called the summarizer"

    # Compacted in the background: a checkpoint reached the model, and the request that first
    # carried it was smaller than the one before.
    carried = [any(LANGCHAIN_PREFIX in str(m.get("content")) for m in r.body["messages"])
               for r in agent_calls]
    first = carried.index(True)
    assert agent_calls[first].body_bytes < agent_calls[first - 1].body_bytes
    # Each step adds about the same bytes (a digit more here and there): what request n would
    # have been without compactd, from the last request without a checkpoint.
    sizes = [r.body_bytes for r in agent_calls]
    step_bytes = (sizes[first - 1] - sizes[0]) // (first - 1)
    uncompacted = sizes[:first] + [sizes[first - 1] + (n - first + 1) * step_bytes
                                   for n in range(first, STEPS + 1)]
    assert all(size < full for size, full in zip(sizes[first:], uncompacted[first:],
                                                 strict=True))
    assert sizes[-1] < uncompacted[-1] / 2, (sizes[-1], uncompacted[-1])
    largest_after = max(sizes[first:])

    # No step waited for a summary: steps went on while one was being written, and what the
    # middleware added to a step stayed far below one summary's latency.
    during = [r for r in agent_calls for s in summaries
              if s.received_t < r.received_t < (s.answered_t or 0)]
    assert len(during) >= 5, "no agent step ran while a summary was in flight"
    overheads = [o - i for o, i in zip(outer.seconds, inner.seconds, strict=True)]
    assert len(overheads) == STEPS + 1
    # The first step also starts the middleware's loop thread and pool and opens the session.
    first_step, steps = overheads[0], overheads[1:]
    print(f"\nmiddleware overhead per step: first {first_step * 1000:.0f} ms, then median "
          f"{statistics.median(steps) * 1000:.1f} ms, p95 "
          f"{sorted(steps)[int(0.95 * len(steps))] * 1000:.1f} ms, max {max(steps) * 1000:.1f} ms;"
          f" {len(summaries)} summaries, {sum(carried)} of {len(carried)} requests carried a "
          f"checkpoint; request bytes {agent_calls[first - 1].body_bytes} -> "
          f"{agent_calls[first].body_bytes}, largest after {largest_after}, last "
          f"{sizes[-1]} (uncompacted {uncompacted[-1]})")
    assert max(steps) < SUMMARY_LATENCY_S / 2, steps
    assert first_step < 10 * SUMMARY_LATENCY_S

    # What the model was last sent: no orphan tool result, no call without its result.
    final = agent_calls[-1].body["messages"]
    assert final[0]["role"] == "system" and LANGCHAIN_PREFIX in str(final)
    assert_tool_pairs_whole(final)

    async def stored() -> tuple[int, bool]:
        store = Store.from_url(stack.database_url)
        try:
            events = await store.read_events("agent-1", kinds=["message"])
            return len(events), (await store.verify("agent-1")).ok
        finally:
            await store.close()

    mirrored, verified = asyncio.run(stored())
    assert verified and mirrored == len(state)
    assert "1/1 sessions verified" in stack.cli("verify", "--all").stdout
