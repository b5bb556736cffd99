"""DeerFlow's conversations through compactd: the flags its messages carry survive the
LangChain middleware as they survive ``compactd ingest --format langchain``, and the request
after a ``durable_context`` compaction holds one system message, first (strict
OpenAI-compatible servers refuse any other). Real SQLite and PostgreSQL, the real OpenAI SDK
against the fake provider in its strict mode, the CLI as a subprocess."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import openai
import pytest
from langchain.agents import create_agent
from langchain_core.messages import BaseMessage
from langchain_core.tools import tool
from langgraph.checkpoint.memory import InMemorySaver

from compactd.scheduler.client import CompactdClient
from compactd.scheduler.langchain import CompactdMiddleware, to_compactd
from compactd.storage.store import Store
from compactd.worker.compaction.render import AUTHORITY_CONTRACT
from compactd.worker.orchestration import compact
from compactd.worker.runtime import open_deps
from tests.conftest import run_cli
from tests.support.chat_models import fake_chat_openai
from tests.support.deerflow import (
    LOADED_SKILL,
    MEMORY,
    NUDGE,
    REQUEST,
    active_skills,
    conversation,
    ingest_lines,
    kept,
)
from tests.support.enqueuer import RecordingEnqueuer
from tests.support.fake_provider import Behaviour, FakeProvider
from tests.support.langchain_agents import compact_now, make_config

AGENT_MODEL = "agent-gpt"
SYSTEM = "You are DeerFlow's lead agent."
CONFIG_YAML = "summarization:\n  trigger: [{type: tokens, value: 1000000000}]\n"
WIRE_KEYS = ("role", "content", "tool_calls", "tool_call_id", "name")


def system_roles(body: dict[str, Any]) -> list[int]:
    return [i for i, m in enumerate(body["messages"]) if m["role"] in ("system", "developer")]


def wire(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Surface messages as a runtime sends them (compactd's own keys left out)."""
    return [{k: m[k] for k in WIRE_KEYS if m.get(k) is not None} for m in messages]


@pytest.fixture
def cli(cli_env: dict[str, str], db_url: str, tmp_path: Path) -> dict[str, str]:
    config = tmp_path / "compactd.yaml"
    config.write_text(CONFIG_YAML)
    return {**cli_env, "COMPACTD_DATABASE_URL": db_url, "COMPACTD_CONFIG": str(config)}


async def test_the_middleware_keeps_what_ingest_keeps_of_a_deerflow_conversation(
        fake: FakeProvider, db_url: str, tmp_path: Path, cli: dict[str, str]) -> None:
    """The same messages, stored by the middleware (an agent's state) and by ``ingest
    --format langchain``, then compacted alike: the same messages stay verbatim (the user's
    request and DeerFlow's memory reminder, not the hidden nudge after them) and the same
    skills are active (not the read the sandbox refused with an error status)."""
    messages = conversation()
    *state, last = messages
    fake.script(Behaviour(model=AGENT_MODEL, output="text", text=str(last.content)))
    middleware = CompactdMiddleware(config=make_config(db_url, tmp_path))
    agent = create_agent(fake_chat_openai(fake.openai_base_url, AGENT_MODEL, max_retries=0),
                         tools=[], middleware=[middleware], system_prompt=SYSTEM,
                         checkpointer=InMemorySaver())
    try:
        await agent.ainvoke({"messages": state}, {"configurable": {"thread_id": "middleware"}})
    finally:
        middleware.close()
    path = tmp_path / "deerflow.jsonl"
    path.write_text(ingest_lines(messages))
    run_cli(cli, "ingest", str(path), "--session", "ingest", "--format", "langchain",
            "--run-model", AGENT_MODEL)

    store = Store.from_url(db_url)
    try:
        stored = {sid: [e.payload for e in await store.read_events(sid, kinds=["message"])]
                  for sid in ("middleware", "ingest")}
    finally:
        await store.close()
    assert len(stored["middleware"]) == len(stored["ingest"]) == len(messages)
    flags = {sid: [{k: v for k, v in (p.get("meta") or {}).items() if k != "lc_id"}
                   for p in payloads[:-1]]  # the last answer is the fake's own message
             for sid, payloads in stored.items()}
    assert flags["middleware"] == flags["ingest"]

    surfaces = {}
    for sid in ("middleware", "ingest"):
        out = json.loads(run_cli(cli, "compact", sid, "--inline", "--force", "--keep",
                                 "messages:4", "--json").stdout)
        assert out["outcome"] == "committed", out
        surfaces[sid] = json.loads(run_cli(cli, "surface", sid, "--json").stdout)
    assert kept(surfaces["middleware"]) == kept(surfaces["ingest"])
    texts = [text for _, text, _ in kept(surfaces["ingest"])]
    assert REQUEST in texts and MEMORY in texts and NUDGE not in texts
    assert active_skills(surfaces["middleware"]) == active_skills(surfaces["ingest"]) == [
        LOADED_SKILL]


def test_an_error_status_and_additional_kwargs_ride_in_meta() -> None:
    by_id = {m.id: m for m in conversation()}
    [memory, refused] = to_compactd([by_id["u-memory"], by_id["t-read-2"]])
    assert memory["meta"] == {"dynamic_context_reminder": True, "hide_from_ui": True,
                              "lc_id": "u-memory"}
    assert refused["meta"] == {"is_error": True, "lc_id": "t-read-2"}


# ------------------------------------------------------------------------------------------
# one system message, first


def steps_agent(fake: FakeProvider, middleware: CompactdMiddleware, system_prompt: str | None,
                on_step: Any) -> Any:
    calls = {"n": 0}

    @tool
    def lookup() -> str:
        """Look something up."""
        calls["n"] += 1
        on_step(calls["n"])
        return f"result {calls['n']}: " + "lorem ipsum dolor sit amet " * 120

    return create_agent(fake_chat_openai(fake.openai_base_url, AGENT_MODEL, max_retries=0),
                        tools=[lookup], middleware=[middleware], system_prompt=system_prompt,
                        checkpointer=InMemorySaver())


@pytest.mark.parametrize("system_prompt", [SYSTEM, None])
async def test_after_a_durable_context_compaction_the_middleware_sends_one_system_message(
        fake: FakeProvider, db_url: str, tmp_path: Path, system_prompt: str | None) -> None:
    fake.strict_system = True
    config = make_config(db_url, tmp_path)
    middleware = CompactdMiddleware(config=config, render="durable_context")
    outcomes: list[str] = []
    fake.script(Behaviour(model=AGENT_MODEL, output="tool_calls", times=6),
                Behaviour(model=AGENT_MODEL, output="text", text="done"))
    agent = steps_agent(fake, middleware, system_prompt, lambda n: outcomes.append(
        compact_now(config, "s1")) if n == 3 else None)
    try:
        out = await agent.ainvoke({"messages": [{"role": "user", "content": "go"}]},
                                  {"configurable": {"thread_id": "s1"}})
    finally:
        middleware.close()
    assert outcomes == ["committed"] and out["messages"][-1].content == "done"
    bodies = [r.body for r in fake.requests_for(model=AGENT_MODEL) if r.body is not None]
    assert [r.status for r in fake.requests_for(model=AGENT_MODEL)] == [200] * 7
    after = [b for b in bodies if "<durable_context_data>" in json.dumps(b)]
    assert len(after) == 4  # the calls after the compaction
    for body in bodies:
        assert system_roles(body) == ([0] if system_prompt or body in after else [])
    for body in after:
        head = body["messages"][0]["content"]
        assert AUTHORITY_CONTRACT in json.dumps(head)
        assert (SYSTEM in json.dumps(head)) is (system_prompt is not None)
        assert json.dumps(body).count("never as instructions") == 1


async def test_after_a_durable_context_compaction_the_client_surface_goes_out_as_one_system(
        fake: FakeProvider, db_url: str, store: Store, tmp_path: Path) -> None:
    """The two ways a runtime holds its system prompt: as the envelope, sent before the
    surface (the README's flow), or as the session's first message."""
    fake.strict_system = True
    config = make_config(db_url, tmp_path)
    llm = openai.AsyncOpenAI(base_url=fake.openai_base_url, api_key="sk-fake", max_retries=0)
    history: list[BaseMessage] = conversation()
    async with CompactdClient(config, store=store, enqueuer=RecordingEnqueuer()) as client:
        envelope = await client.create_session("envelope", envelope={"system": SYSTEM},
                                               policy={"render": "durable_context"})
        await envelope.append(to_compactd(history))
        inline = await client.create_session("inline", policy={"render": "durable_context"})
        await inline.append([{"role": "system", "content": SYSTEM}, *to_compactd(history)])
        async with open_deps(config, owner="test") as deps:
            for sid in ("envelope", "inline"):
                outcome = await compact(deps, sid, trigger="manual", force=True)
                assert outcome.outcome == "committed", outcome
        requests = {
            "envelope": [{"role": "system", "content": SYSTEM},
                         *wire(await envelope.surface())],
            "inline": wire(await inline.surface()),
        }
    try:
        for messages in requests.values():
            await llm.chat.completions.create(model=AGENT_MODEL, messages=messages)  # type: ignore[arg-type]
    finally:
        await llm.close()
    bodies = [r.body for r in fake.requests_for(model=AGENT_MODEL) if r.body is not None]
    assert len(bodies) == 2
    for body in bodies:
        assert system_roles(body) == [0]
        assert SYSTEM in json.dumps(body["messages"][0])
        assert json.dumps(body).count("never as instructions") == 1
        assert "<durable_context_data>" in json.dumps(body)
