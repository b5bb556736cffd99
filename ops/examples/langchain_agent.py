"""A LangChain agent whose context compactd compacts in the background.

    pip install 'compactd[langchain]' langchain-openai
    export OPENAI_API_KEY=sk-...        # OPENAI_BASE_URL for any OpenAI-compatible server
    celery -A compactd.worker.app worker &   # the background compaction (same COMPACTD_* settings)
    python ops/examples/langchain_agent.py

With no ``COMPACTD_*`` settings it runs on the embedded default (a SQLite file in the current
directory); ``compactd surface example-session`` then shows what the model was sent.
"""

from __future__ import annotations

import os

from langchain.agents import create_agent
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.checkpoint.memory import InMemorySaver

from compactd.scheduler.langchain import CompactdMiddleware


@tool
def lookup(query: str = "") -> str:
    """Look a fact up in the project notes."""
    return f"notes on {query or 'everything'}: the tax rounding bug is in billing/tax.py"


def main() -> None:
    model = ChatOpenAI(model=os.environ.get("MODEL", "gpt-4o-mini"))
    # In place of SummarizationMiddleware(model=..., trigger=..., keep=...): the same trigger
    # and keep, but a worker summarizes in the background; the step never waits for it, and
    # the checkpoint reaches the model at the next step.
    compactd = CompactdMiddleware(trigger=("tokens", 4000), keep=("messages", 20))
    agent = create_agent(model, tools=[lookup], middleware=[compactd],
                         system_prompt="You are a careful coding agent.",
                         checkpointer=InMemorySaver())
    # One LangGraph thread is one compactd session.
    thread = {"configurable": {"thread_id": "example-session"}, "recursion_limit": 200}
    try:
        result = agent.invoke(
            {"messages": [{"role": "user", "content": "Why do the tax tests fail?"}]}, thread)
        print(result["messages"][-1].content)
    finally:
        compactd.close()


if __name__ == "__main__":
    main()
