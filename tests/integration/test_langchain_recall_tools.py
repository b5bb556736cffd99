"""CompactdMiddleware's recall tools in a real LangChain agent (``create_agent``, ChatOpenAI
through the real SDK against the scripted fake provider), sync and async, on real SQLite and
PostgreSQL. The compaction runs in-process between two invocations of the thread (the
orchestration a worker runs); the background worker run is
``tests/acceptance/test_langchain_recall.py``."""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from langchain.agents import create_agent
from langchain_core.messages import AIMessage, ToolMessage
from langchain_core.tools import tool
from langgraph.checkpoint.memory import InMemorySaver

from compactd.scheduler.langchain import CompactdMiddleware
from compactd.storage.store import Store
from compactd.worker.compaction.recall_tools import tool_schemas
from tests.support.chat_models import fake_chat_openai
from tests.support.fake_provider import Behaviour, FakeProvider
from tests.support.langchain_agents import (
    AGENT_MODEL,
    assert_tool_pairs_whole,
    compact_now,
    make_config,
)
from tests.support.tables import row_counts

NEEDLE = "the refund for order ord_7f3c9a1e was issued twice"
VALUE = "ord_7f3c9a1e"
FILLER = "lorem ipsum dolor sit amet " * 120
MODES = ["sync", "async"]


def recall_agent(fake: FakeProvider, middleware: CompactdMiddleware) -> Any:
    calls = {"n": 0}

    @tool
    def lookup() -> str:
        """Look something up."""
        calls["n"] += 1
        planted = f"\n{NEEDLE}\n" if calls["n"] == 2 else "\n"
        return f"result {calls['n']}: {FILLER[:1500]}{planted}{FILLER[1500:]}"

    model = fake_chat_openai(fake.openai_base_url, AGENT_MODEL, max_retries=0)
    return create_agent(model, tools=[lookup], middleware=[middleware],
                        system_prompt="You are a careful agent.", checkpointer=InMemorySaver())


class Runs:
    """Runs an agent or a tool the sync way (``invoke``) or the async way (``ainvoke``, every
    call on one event loop, as an async application has it: the chat model's HTTP client
    belongs to the loop it was first used on)."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.runner = asyncio.Runner() if mode == "async" else None

    def invoke(self, target: Any, value: Any, config: dict[str, Any]) -> Any:
        if self.runner is None:
            return target.invoke(value, config)
        return self.runner.run(target.ainvoke(value, config))

    def agent(self, agent: Any, text: str, thread: str) -> list[Any]:
        out = self.invoke(agent, {"messages": [{"role": "user", "content": text}]},
                          {"configurable": {"thread_id": thread}})
        return list(out["messages"])

    def close(self) -> None:
        if self.runner is not None:
            self.runner.close()


@pytest.fixture(params=MODES)
def runs(request: pytest.FixtureRequest) -> Iterator[Runs]:
    runs = Runs(request.param)
    try:
        yield runs
    finally:
        runs.close()


def compacted_thread(fake: FakeProvider, agent: Any, runs: Runs, config: Any,
                     thread: str) -> None:
    """Six tool steps, the second result holding the needle; then a compaction replaces it."""
    fake.script(Behaviour(model=AGENT_MODEL, output="tool_calls", times=6),
                Behaviour(model=AGENT_MODEL, output="text", text="audited"))
    runs.agent(agent, "Audit the refunds.", thread)
    assert compact_now(config, thread) == "committed"


def search_call(**arguments: Any) -> dict[str, Any]:
    return {"name": "history_search", "arguments": arguments}


def read_call(**arguments: Any) -> dict[str, Any]:
    return {"name": "history_read", "arguments": arguments}


def from_result(path: str) -> dict[str, str]:
    return {"$from_result": path}


def sent(fake: FakeProvider) -> list[dict[str, Any]]:
    return [r.body for r in fake.requests_for(model=AGENT_MODEL) if r.body is not None]


def at_store(db_url: str, run: Any) -> Any:
    async def go() -> Any:
        store = Store.from_url(db_url)
        try:
            return await run(store)
        finally:
            await store.close()

    return asyncio.run(go())


@pytest.fixture
def config(db_url: str, tmp_path: Path) -> Any:
    return make_config(db_url, tmp_path)


# ------------------------------------------------------------------------------------------


def test_the_model_searches_then_reads_back_what_a_checkpoint_replaced(
        fake: FakeProvider, config: Any, db_url: str, runs: Runs) -> None:
    middleware = CompactdMiddleware(config=config)
    agent = recall_agent(fake, middleware)
    try:
        compacted_thread(fake, agent, runs, config, "t1")
        earlier = len(sent(fake))
        fake.script(
            Behaviour(model=AGENT_MODEL, output="tool_calls",
                      tool_calls=[search_call(query="issued twice")]),
            Behaviour(model=AGENT_MODEL, output="tool_calls",
                      tool_calls=[read_call(checkpoint=from_result("hits.0.checkpoint"))]),
            Behaviour(model=AGENT_MODEL, output="text", text="It was {quote}.",
                      quote=r"ord_[0-9a-f]{8}"))
        state = runs.agent(agent, "Which order was refunded twice?", "t1")
    finally:
        middleware.close()

    requests = sent(fake)[earlier:]
    assert len(requests) == 3
    assert VALUE not in json.dumps(requests[0]["messages"]), "the needle was still in view"
    searched, read = (m for m in state if isinstance(m, ToolMessage)
                      and m.name in ("history_search", "history_read"))
    assert searched.status == read.status == "success"
    hit = json.loads(str(searched.content))["hits"][0]
    assert hit["exact"] and VALUE in hit["snippet"]
    recall = [c for m in state if isinstance(m, AIMessage) for c in m.tool_calls
              if c["name"].startswith("history_")]
    assert [c["args"] for c in recall] == [{"query": "issued twice"},
                                          {"checkpoint": hit["checkpoint"]}]
    assert str(read.content).startswith(f"[{hit['checkpoint']} replaced ")
    assert NEEDLE in str(read.content)
    assert state[-1].content == f"It was {VALUE}."
    for request in requests:
        assert_tool_pairs_whole(request["messages"])

    async def check(store: Store) -> tuple[bool, int, str]:
        events = await store.read_events("t1", kinds=["message"])
        original = next(e.payload["content"] for e in events if e.seq == hit["seq"])
        return (await store.verify("t1")).ok, len(events), original

    verified, mirrored, original = at_store(db_url, check)
    # The tool results are ordinary messages of the session, mirrored like the rest (the final
    # answer is mirrored after the agent ends).
    assert verified and mirrored == len(state) and NEEDLE in original


def test_bad_arguments_answer_the_model_naming_the_argument_and_the_agent_goes_on(
        fake: FakeProvider, config: Any, db_url: str) -> None:
    middleware = CompactdMiddleware(config=config)
    agent = recall_agent(fake, middleware)
    runs = Runs("async")
    try:
        compacted_thread(fake, agent, runs, config, "t2")

        async def first_page(store: Store) -> tuple[str, str | None]:
            hit = (await store.history_search("t2", "issued twice")).hits[0]
            page = await store.history_read("t2", hit.checkpoint, budget_tokens=64)
            return hit.checkpoint, page.cursor

        ref, cursor = at_store(db_url, first_page)
        assert cursor is not None
        bad = {
            "query": search_call(query=""),
            "query ": search_call(query="x" * 10_240),
            "limit": search_call(query="x", limit=101),
            "checkpoint": read_call(checkpoint="c999999-1000000"),
            "checkpoint ": search_call(query="x", checkpoint="nope"),
            "offset": read_call(checkpoint=ref, offset=-1),
            "cursor": read_call(checkpoint="r1", cursor=cursor),
            "cursor ": read_call(checkpoint=ref, cursor="garbage"),
            "cursor  ": read_call(checkpoint=ref, offset=2, cursor=cursor),
            "budget_tokens": read_call(checkpoint=ref, budget_tokens=10),
            "regex": search_call(query="x", regex=True),
        }
        fake.script(Behaviour(model=AGENT_MODEL, output="tool_calls",
                              tool_calls=list(bad.values())),
                    Behaviour(model=AGENT_MODEL, output="text", text="I could not tell."))
        before = at_store(db_url, row_counts)
        state = runs.agent(agent, "Which order was refunded twice?", "t2")
    finally:
        middleware.close()
        runs.close()

    assert state[-1].content == "I could not tell."
    errors = [m for m in state if isinstance(m, ToolMessage) and m.status == "error"]
    assert len(errors) == len(bad)
    for argument, message in zip(bad, errors, strict=True):
        assert f"refused its {argument.strip()} argument" in str(message.content), (
            argument, message.content)
    # The refusals reached the model as tool results, each right after its call.
    last = sent(fake)[-1]["messages"]
    assert [m["role"] for m in last[-len(bad) - 1:]] == ["assistant"] + ["tool"] * len(bad)
    assert_tool_pairs_whole(last)
    # Nothing was written but the turn's messages: the question, the call, its eleven results
    # (mirrored at the next model call) and the answer.
    after = at_store(db_url, row_counts)
    assert after["events"] - before["events"] == 1 + 1 + len(bad) + 1
    assert {k: after[k] for k in ("compaction_runs", "recall_nodes", "recall_originals")} == {
        k: before[k] for k in ("compaction_runs", "recall_nodes", "recall_originals")}


def test_a_tool_called_before_any_model_call_opens_the_session_and_writes_nothing(
        fake: FakeProvider, config: Any, db_url: str, runs: Runs,
        caplog: pytest.LogCaptureFixture) -> None:
    first = CompactdMiddleware(config=config)
    try:
        compacted_thread(fake, recall_agent(fake, first), runs, config, "t3")
    finally:
        first.close()
    # A new process: its middleware has opened no session yet.
    middleware = CompactdMiddleware(config=config)
    other_tenant = CompactdMiddleware(config=config, tenant="someone-else")
    search, read, _compact = middleware.tools
    run_config = {"configurable": {"thread_id": "t3"}}

    def call(target: Any, arguments: dict[str, Any]) -> ToolMessage:
        payload = {"name": target.name, "args": arguments, "id": "call-1", "type": "tool_call"}
        answer: ToolMessage = runs.invoke(target, payload, run_config)
        return answer

    try:
        before = at_store(db_url, row_counts)
        found = call(search, {"query": "issued twice"})
        hit = json.loads(str(found.content))["hits"][0]
        page = call(read, {"checkpoint": hit["checkpoint"], "budget_tokens": 100_000})
        # Paged: each page ends with the call that continues it, cursor included.
        pages = [call(read, {"checkpoint": hit["checkpoint"], "budget_tokens": 64})]
        while (more := re.search(r'cursor="([^"]+)"\)\]$', str(pages[-1].content))):
            pages.append(call(read, {"checkpoint": hit["checkpoint"], "budget_tokens": 64,
                                     "cursor": more.group(1)}))
        refused = call(read, {"checkpoint": hit["checkpoint"], "offset": -1})
        # A lone surrogate (a runtime's bytes that are not UTF-8): bad input for the model to
        # fix, not compactd unreachable, and nothing for the operator's log.
        with caplog.at_level(logging.WARNING, logger="compactd.scheduler.langchain"):
            lone = call(search, {"query": "disk \ud800 full"})
        elsewhere = call(other_tenant.tools[0], {"query": "issued twice"})
        after = at_store(db_url, row_counts)
    finally:
        middleware.close()
        other_tenant.close()
    assert found.status == page.status == "success"
    assert NEEDLE in str(page.content)
    assert str(page.content).endswith(f"[end of {hit['checkpoint']}]")
    assert len(pages) > 2 and all(p.status == "success" for p in pages)
    assert str(pages[-1].content).endswith(f"[end of {hit['checkpoint']}]")
    assert NEEDLE in "".join(str(p.content).split("\n", 1)[1].rsplit("\n", 1)[0]
                             for p in pages)
    assert refused.status == "error" and "offset" in str(refused.content)
    assert lone.status == "error", lone.content
    assert "refused its query argument: is not valid UTF-8" in str(lone.content), lone.content
    assert not [r for r in caplog.records if r.name == "compactd.scheduler.langchain"]
    # Another tenant's session is not there for this middleware's tools.
    assert elsewhere.status == "error" and VALUE not in str(elsewhere.content)
    assert "nothing of this conversation is stored" in str(elsewhere.content)
    assert after == before


def test_the_model_is_offered_the_shipped_schemas_unless_turned_off(
        fake: FakeProvider, config: Any) -> None:
    offered: dict[bool, list[dict[str, Any]]] = {}
    for recall in (True, False):
        middleware = CompactdMiddleware(config=config, recall_tools=recall)
        earlier = len(sent(fake))
        fake.script(Behaviour(model=AGENT_MODEL, output="text", text="hi"))
        try:
            Runs("sync").agent(recall_agent(fake, middleware), "hello", f"offer-{recall}")
        finally:
            middleware.close()
        offered[recall] = sent(fake)[earlier]["tools"]
    assert offered[True][:3] == tool_schemas("openai")
    assert [t["function"]["name"] for t in offered[True][3:]] == ["lookup"]
    assert [t["function"]["name"] for t in offered[False]] == ["lookup"]
    assert CompactdMiddleware(recall_tools=False).tools == []


def test_when_compactd_is_unreachable_a_recall_answers_an_error_and_the_agent_goes_on(
        fake: FakeProvider, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    config = make_config("postgresql://postgres@127.0.0.1:1/compactd", tmp_path)
    middleware = CompactdMiddleware(config=config)
    fake.script(Behaviour(model=AGENT_MODEL, output="tool_calls",
                          tool_calls=[search_call(query="issued twice")]),
                Behaviour(model=AGENT_MODEL, output="text", text="no history"))
    try:
        with caplog.at_level(logging.WARNING, logger="compactd.scheduler.langchain"):
            state = Runs("sync").agent(recall_agent(fake, middleware), "Which order?", "down")
    finally:
        middleware.close()
    [result] = [m for m in state if isinstance(m, ToolMessage)]
    assert result.status == "error" and "unavailable right now" in str(result.content)
    assert state[-1].content == "no history"
    assert any("recall tool could not reach compactd" in r.getMessage() for r in caplog.records)
