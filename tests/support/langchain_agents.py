"""A real LangChain agent (``create_agent``, ChatOpenAI through the real SDK against the fake
provider) with compactd's middleware, and a compaction run to completion in the test's thread,
as the LangChain and DeerFlow tests drive them.

    middleware = CompactdMiddleware(config=make_config(db_url, tmp_path))
    agent_for(fake, middleware, on_call=lambda n: compact_now(config, "s1") if n == 3 else None)
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

from langchain.agents import create_agent
from langchain_core.tools import tool
from langgraph.checkpoint.memory import InMemorySaver

from compactd.scheduler.langchain import CompactdMiddleware
from compactd.worker.orchestration import compact
from compactd.worker.runtime import open_deps
from compactd.worker.settings import Config, Settings, build_config
from tests.support.chat_models import fake_chat_openai
from tests.support.fake_provider import FakeProvider
from tests.support.pairs import request_problems

AGENT_MODEL = "agent-gpt"
TOOL_OUTPUT = "lorem ipsum dolor sit amet " * 120


def make_config(database_url: str, home: Path) -> Config:
    # No models configured: compactions use the local summarizer; the broker is the embedded
    # one (nothing consumes it here).
    return build_config({"summarization": {"trigger": [{"type": "tokens", "value": 10**9}]}},
                        settings=Settings(database_url=database_url, home=str(home)), home=home)


def compact_now(config: Config, session: str) -> str:
    """What a worker does, run to completion in this thread (its own loop and engine)."""
    async def run() -> str:
        async with open_deps(config, owner="test") as deps:
            outcome = await compact(deps, session, trigger="manual", force=True)
        return str(outcome.to_json()["outcome"])

    return asyncio.run(run())


def agent_for(fake: FakeProvider, middleware: CompactdMiddleware,
              on_call: Callable[[int], None] | None = None) -> Any:
    calls = {"n": 0}

    @tool
    def lookup() -> str:
        """Look something up."""
        calls["n"] += 1
        if on_call is not None:
            on_call(calls["n"])
        return f"result {calls['n']}: {TOOL_OUTPUT}"

    model = fake_chat_openai(fake.openai_base_url, AGENT_MODEL, max_retries=0)
    return create_agent(model, tools=[lookup], middleware=[middleware],
                        system_prompt="You are a careful agent.", checkpointer=InMemorySaver())


def assert_tool_pairs_whole(messages: list[dict[str, Any]]) -> None:
    """No tool result without its call before it, no call without its result after it."""
    problems = request_problems(messages)
    assert not problems, problems
