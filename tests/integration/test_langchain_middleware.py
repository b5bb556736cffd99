"""CompactdMiddleware in a real LangChain agent (``create_agent``, ChatOpenAI through the real
SDK against the fake provider), on real SQLite and PostgreSQL. Compactions here run in-process
(the orchestration a worker runs) at a chosen step, so each swap is deterministic; the background
worker run is ``tests/acceptance/test_langchain_agent.py``."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage

from compactd.scheduler.langchain import (
    CompactdMiddleware,
    StateMismatch,
    to_compactd,
    to_langchain,
)
from compactd.storage import schema as t
from compactd.storage.database import transaction
from compactd.storage.store import Store
from compactd.worker.compaction.render import LANGCHAIN_PREFIX
from compactd.worker.settings import Settings, build_config
from tests.support.fake_provider import Behaviour, FakeProvider
from tests.support.langchain_agents import (
    AGENT_MODEL,
    agent_for,
    assert_tool_pairs_whole,
    compact_now,
    make_config,
)


def script_steps(fake: FakeProvider, tool_steps: int, answer: str = "done") -> None:
    fake.script(Behaviour(model=AGENT_MODEL, output="tool_calls", times=tool_steps),
                Behaviour(model=AGENT_MODEL, output="text", text=answer))


def sent_messages(fake: FakeProvider) -> list[list[dict[str, Any]]]:
    return [list(r.body["messages"]) for r in fake.requests_for(model=AGENT_MODEL)
            if r.body is not None]


@pytest.fixture
def middleware(db_url: str, tmp_path: Path) -> Iterator[CompactdMiddleware]:
    mw = CompactdMiddleware(config=make_config(db_url, tmp_path))
    try:
        yield mw
    finally:
        mw.close()


async def read_events(db_url: str, session: str) -> list[Any]:
    store = Store.from_url(db_url)
    try:
        return await store.read_events(session, kinds=["message"])
    finally:
        await store.close()


async def append_keys(db_url: str, session: str) -> list[str]:
    store = Store.from_url(db_url)
    try:
        async with transaction(store.engine) as conn:
            return list((await conn.execute(
                sa.select(t.append_keys.c.key).where(t.append_keys.c.session_id == session)
            )).scalars())
    finally:
        await store.close()


async def stored(db_url: str, session: str) -> tuple[list[dict[str, Any]], Any, bool]:
    store = Store.from_url(db_url)
    try:
        events = await store.read_events(session, kinds=["message"])
        info = await store.get_session(session)
        verified = (await store.verify(session)).ok
    finally:
        await store.close()
    return [e.payload for e in events], info, verified


# ------------------------------------------------------------------------------------------


async def test_every_state_message_is_mirrored_once_in_order_and_usage_reported(
        fake: FakeProvider, middleware: CompactdMiddleware, db_url: str) -> None:
    script_steps(fake, 5)
    agent = agent_for(fake, middleware)
    out = await agent.ainvoke({"messages": [{"role": "user", "content": "go"}]},
                              {"configurable": {"thread_id": "s1"}})
    state = out["messages"]
    assert state[-1].content == "done" and len(state) == 12

    payloads, info, verified = await stored(db_url, "s1")
    assert verified
    assert [p["role"] for p in payloads] == [m["role"] for m in to_compactd(state)]
    assert [(p.get("meta") or {}).get("lc_id") for p in payloads] == [m.id for m in state]
    assert info.envelope_tokens > 0 and info.run_model == AGENT_MODEL
    # Each step's append carried the key the middleware derives for it (a retry of the step
    # is answered from the first, never stored twice).
    keys = await append_keys(db_url, "s1")
    assert len(keys) >= len(sent_messages(fake)) and all(k.startswith("lc-") for k in keys)
    # The provider's own count for the last call (the fake's prompt_tokens) was reported.
    last = fake.requests_for(model=AGENT_MODEL)[-1]
    assert info.reported_input_tokens == -(-last.body_bytes // 4)
    # And its output (the answer "done"): the response, mirrored after the report, is counted
    # by it once, not again as an appended message.
    assert info.reported_output_tokens == 1
    answer = (await read_events(db_url, "s1"))[-1]
    assert answer.payload["content"] == "done"
    assert info.reported_tokens == info.reported_input_tokens + max(1, answer.tokens)
    # Without a checkpoint, the model saw exactly what it would have seen without compactd.
    for request, n in zip(sent_messages(fake), range(1, 7), strict=True):
        assert [m["role"] for m in request][:2] == ["system", "user"]
        assert len(request) == 2 * n


async def test_a_checkpoint_replaces_history_in_the_next_request_only(
        fake: FakeProvider, db_url: str, tmp_path: Path) -> None:
    config = make_config(db_url, tmp_path)
    middleware = CompactdMiddleware(config=config)
    outcomes: list[str] = []
    script_steps(fake, 8)
    agent = agent_for(fake, middleware, on_call=lambda n: outcomes.append(
        compact_now(config, "s1")) if n == 5 else None)
    try:
        out = await agent.ainvoke({"messages": [{"role": "user", "content": "go"}]},
                                  {"configurable": {"thread_id": "s1"}})
    finally:
        middleware.close()
    assert outcomes == ["committed"]
    requests = sent_messages(fake)
    sizes = [r.body_bytes for r in fake.requests_for(model=AGENT_MODEL)]
    summarized = [any(LANGCHAIN_PREFIX in str(m.get("content")) for m in r) for r in requests]
    # Calls 1-5 ran before the compaction, 6-9 after it.
    assert summarized == [False] * 5 + [True] * 4
    assert sizes[5] < sizes[4], sizes
    # The state keeps the whole history; only the model request was compacted.
    assert len(out["messages"]) == 1 + 2 * 8 + 1
    assert not any(LANGCHAIN_PREFIX in str(m.content) for m in out["messages"])
    for request in requests:
        assert_tool_pairs_whole(request)
    payloads, _, verified = await stored(db_url, "s1")
    assert verified and len(payloads) == len(out["messages"])


def test_the_sync_path_mirrors_the_same_way(fake: FakeProvider,
                                            middleware: CompactdMiddleware,
                                            db_url: str) -> None:
    script_steps(fake, 3)
    out = agent_for(fake, middleware).invoke(
        {"messages": [{"role": "user", "content": "go"}]},
        {"configurable": {"thread_id": "sync-1"}})
    payloads, _, verified = asyncio.run(stored(db_url, "sync-1"))
    assert verified and len(payloads) == len(out["messages"]) == 8


async def test_a_second_invocation_of_the_thread_appends_only_what_is_new(
        fake: FakeProvider, middleware: CompactdMiddleware, db_url: str) -> None:
    agent = agent_for(fake, middleware)
    thread = {"configurable": {"thread_id": "s2"}}
    script_steps(fake, 2, answer="first")
    await agent.ainvoke({"messages": [{"role": "user", "content": "one"}]}, thread)
    script_steps(fake, 1, answer="second")
    out = await agent.ainvoke({"messages": [{"role": "user", "content": "two"}]}, thread)
    payloads, _, verified = await stored(db_url, "s2")
    assert verified
    assert [p.get("content") for p in payloads if p["role"] == "user"] == ["one", "two"]
    assert len(payloads) == len(out["messages"]) == 10


async def test_a_fresh_state_for_a_session_with_messages_raises_instead_of_duplicating(
        fake: FakeProvider, middleware: CompactdMiddleware, db_url: str) -> None:
    script_steps(fake, 1)
    await agent_for(fake, middleware).ainvoke(
        {"messages": [{"role": "user", "content": "go"}]}, {"configurable": {"thread_id": "s3"}})
    # Same session id, but a new agent (a new checkpointer): its state has mirrored nothing.
    script_steps(fake, 1)
    with pytest.raises(StateMismatch, match="already holds"):
        await agent_for(fake, middleware).ainvoke(
            {"messages": [{"role": "user", "content": "again"}]},
            {"configurable": {"thread_id": "s3"}})
    payloads, _, _ = await stored(db_url, "s3")
    assert len(payloads) == 4


async def test_when_compactd_is_unreachable_the_agent_runs_on_uncompacted(
        fake: FakeProvider, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    config = make_config("postgresql://postgres@127.0.0.1:1/compactd", tmp_path)
    middleware = CompactdMiddleware(config=config)
    script_steps(fake, 2)
    try:
        with caplog.at_level(logging.WARNING, logger="compactd.scheduler.langchain"):
            out = await agent_for(fake, middleware).ainvoke(
                {"messages": [{"role": "user", "content": "go"}]},
                {"configurable": {"thread_id": "s4"}})
    finally:
        middleware.close()
    assert out["messages"][-1].content == "done"
    assert [len(r) for r in sent_messages(fake)] == [2, 4, 6]
    assert any("compactd unreachable" in r.getMessage() for r in caplog.records)


async def test_a_lost_reply_or_failed_reads_neither_duplicate_nor_drop_a_message(
        fake: FakeProvider, middleware: CompactdMiddleware, db_url: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from compactd.scheduler.client import SessionHandle

    real_append, real_surface = SessionHandle.append, SessionHandle.surface
    appends = {"n": 0}
    reads = {"n": 0}

    async def append(self: SessionHandle, messages: Any, **kw: Any) -> Any:
        appends["n"] += 1
        if appends["n"] == 2:
            raise ConnectionResetError("the database went away before the append")
        result = await real_append(self, messages, **kw)
        if appends["n"] == 4:
            raise ConnectionResetError("the reply to a committed append was lost")
        return result

    async def surface(self: SessionHandle, render: str | None = None, **kw: Any) -> Any:
        reads["n"] += 1
        if reads["n"] in (2, 3):
            raise ConnectionResetError("the read after an append failed")
        return await real_surface(self, render, **kw)

    monkeypatch.setattr(SessionHandle, "append", append)
    monkeypatch.setattr(SessionHandle, "surface", surface)
    script_steps(fake, 6)
    out = await agent_for(fake, middleware).ainvoke(
        {"messages": [{"role": "user", "content": "go"}]}, {"configurable": {"thread_id": "s5"}})
    state = out["messages"]
    assert state[-1].content == "done" and appends["n"] >= 6 and reads["n"] >= 2

    payloads, _, verified = await stored(db_url, "s5")
    assert verified
    assert [(p.get("meta") or {}).get("lc_id") for p in payloads] == [m.id for m in state]
    # Whatever failed, each request still held the whole conversation so far (no checkpoint
    # here): the system prompt, the user's request and every earlier tool round trip.
    for n, request in enumerate(sent_messages(fake), start=1):
        assert len(request) == 2 * n, [m["role"] for m in request]
        assert_tool_pairs_whole(request)


def test_messages_survive_the_round_trip_through_compactd() -> None:
    messages = [
        SystemMessage("rules", id="m0"),
        HumanMessage([{"type": "text", "text": "look at this"}], id="m1"),
        AIMessage("", id="m2", tool_calls=[{"id": "c1", "name": "read", "args": {"path": "a.py"}},
                                           {"id": "c2", "name": "grep", "args": {"q": "x"}}]),
        ToolMessage("contents", tool_call_id="c1", name="read", id="m3"),
        ToolMessage("matches", tool_call_id="c2", name="grep", id="m4"),
        AIMessage("answer", id="m5"),
    ]
    wire = to_compactd(messages)
    back = [to_langchain({**m, "seq": i + 1}) for i, m in enumerate(wire)]
    assert [type(m) for m in back] == [type(m) for m in messages]
    assert [m.id for m in back] == [m.id for m in messages]
    assert back[2].tool_calls == [
        {"id": "c1", "name": "read", "args": {"path": "a.py"}, "type": "tool_call"},
        {"id": "c2", "name": "grep", "args": {"q": "x"}, "type": "tool_call"}]
    assert [m.tool_call_id for m in back[3:5]] == ["c1", "c2"]  # type: ignore[attr-defined]
    assert back[1].content == "look at this" and back[5].content == "answer"
    checkpoint = to_langchain({"seq": 9, "role": "user", "content": f"{LANGCHAIN_PREFIX}\n\nx",
                               "meta": {"checkpoint": True}})
    assert checkpoint.additional_kwargs["lc_source"] == "summarization"
    assert checkpoint.id == "compactd-9"


@pytest.mark.slow
def test_the_readme_example_runs_against_the_fake_provider(
        fake: FakeProvider, cli_env: dict[str, str], tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    from tests.conftest import REPO, compactd_cmd

    fake.script(Behaviour(model="example-model", output="tool_calls", times=3),
                Behaviour(model="example-model", output="text", text="It is a rounding bug."))
    env = {**cli_env, "OPENAI_BASE_URL": fake.openai_base_url, "OPENAI_API_KEY": "sk-fake",
           "MODEL": "example-model"}
    out = subprocess.run([sys.executable, str(REPO / "ops" / "examples" / "langchain_agent.py")],
                         env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip() == "It is a rounding bug."
    surface = subprocess.run([*compactd_cmd(), "surface", "example-session", "--json"],
                             env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    messages = json.loads(surface.stdout)["messages"]
    assert [m["role"] for m in messages] == ["user"] + ["assistant", "tool"] * 3 + ["assistant"]
    assert "billing/tax.py" in messages[2]["content"]


def test_an_unknown_render_form_is_refused_when_the_middleware_is_built() -> None:
    with pytest.raises(ValueError, match="render must be one of"):
        CompactdMiddleware(render="html")


async def test_summarization_middleware_arguments_become_the_session_policy(
        fake: FakeProvider, db_url: str, tmp_path: Path) -> None:
    middleware = CompactdMiddleware(config=make_config(db_url, tmp_path),
                                    trigger=[("tokens", 4000), ("messages", 40)],
                                    keep=("messages", 20))
    script_steps(fake, 1)
    try:
        await agent_for(fake, middleware).ainvoke(
            {"messages": [{"role": "user", "content": "go"}]},
            {"configurable": {"thread_id": "s6"}})
    finally:
        middleware.close()
    _, info, _ = await stored(db_url, "s6")
    assert info.policy == {"trigger": [["tokens", 4000], ["messages", 40]],
                           "keep": ["messages", 20]}
    with pytest.raises(ValueError, match="trigger"):
        CompactdMiddleware(trigger=("tokens", -5))


async def test_trigger_none_turns_automatic_compaction_off(fake: FakeProvider, db_url: str,
                                                           tmp_path: Path) -> None:
    """As SummarizationMiddleware(trigger=None) never summarizes: a configured trigger the
    session is far over enqueues nothing; leaving ``trigger`` out keeps the configured one."""
    config = build_config({"summarization": {"trigger": [{"type": "tokens", "value": 100}]}},
                          settings=Settings(database_url=db_url, home=str(tmp_path)),
                          home=tmp_path)
    for thread, kwargs in (("off", {"trigger": None}), ("configured", {})):
        middleware = CompactdMiddleware(config=config, **kwargs)
        script_steps(fake, 2)
        try:
            await agent_for(fake, middleware).ainvoke(
                {"messages": [{"role": "user", "content": "go"}]},
                {"configurable": {"thread_id": thread}})
        finally:
            middleware.close()
    _, off, _ = await stored(db_url, "off")
    _, configured, _ = await stored(db_url, "configured")
    assert off.surface_tokens > 100 and configured.surface_tokens > 100
    assert off.policy == {"trigger": []} and off.signal_at is None
    assert configured.policy is None and configured.signal_at is not None
    assert repr(CompactdMiddleware.__init__.__kwdefaults__["trigger"]) == "FROM_CONFIG"


async def test_a_trigger_without_keep_keeps_what_summarization_middleware_keeps(
        fake: FakeProvider, db_url: str, tmp_path: Path) -> None:
    """``trigger=("tokens", 4000)`` on a 128k window: compactd's default keep (a share of the
    window, 20,480 tokens) would refire that trigger and be refused at the first step;
    SummarizationMiddleware keeps the last 20 messages, and so does the middleware."""
    config = build_config({}, settings=Settings(database_url=db_url, home=str(tmp_path)),
                          home=tmp_path)
    middleware = CompactdMiddleware(config=config, trigger=("tokens", 4000),
                                    context_window=128_000)
    script_steps(fake, 2)
    try:
        await agent_for(fake, middleware).ainvoke(
            {"messages": [{"role": "user", "content": "go"}]},
            {"configurable": {"thread_id": "t"}})
    finally:
        middleware.close()
    _, info, _ = await stored(db_url, "t")
    assert info.policy == {"trigger": ["tokens", 4000], "keep": ["messages", 20]}
    assert info.surface_messages > 1
