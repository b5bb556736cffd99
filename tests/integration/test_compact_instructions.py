"""Instructions for a manual compaction and the agent's ``compact_context``, over HTTP in process
(ASGI) and through the pipeline run in this process, on real SQLite and PostgreSQL: what is
queued, what the run records, what the loop guard refuses, and bad input changing nothing."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from compactd.storage.instructions import MAX_INSTRUCTION_CHARS, MAX_INSTRUCTIONS
from compactd.storage.kinds import JournalKind, RunCause, RunStatus
from compactd.storage.records import Busy, Claim, RunEnd
from compactd.storage.store import Store
from compactd.worker.orchestration import compact
from compactd.worker.runtime import open_deps
from tests.support.asgi import A, Served, api_config, serve_app

MESSAGES = [{"role": "user" if i % 2 == 0 else "assistant",
             "content": f"message {i} " + "words " * 200} for i in range(30)]


@pytest.fixture
async def api(db_url: str, tmp_path: Path) -> AsyncIterator[Served]:
    # One agent-called run per window: the second call in it is refused.
    config = api_config(db_url, tmp_path, cpu_processes=1,
                        worker={"loop_guard": {"max_compactions": 1}})
    async for served in serve_app(config):
        yield served


async def _session(api: Served) -> None:
    await api.create("s1", A)
    assert (await api.append("s1", A, *MESSAGES)).status_code == 200


async def _held(db_url: str, task_id: str) -> tuple[str, ...]:
    """What the queued manual run of ``task_id`` will be given (taken off the mark, as the
    worker's task takes it when the run starts)."""
    store = Store.from_url(db_url)
    try:
        return await store.clear_manual("s1", task_id)
    finally:
        await store.close()


async def _run(api: Served, task_id: str, instructions: tuple[str, ...]) -> Any:
    """The queued run, as a worker runs it (the task's own steps, in this process)."""
    config = api.app.state.api.config
    async with open_deps(config, owner="test") as deps:
        return await compact(deps, "s1", trigger=RunCause.MANUAL, task_id=task_id,
                             instructions=instructions)


@contextlib.asynccontextmanager
async def _pressure_run(db_url: str) -> AsyncIterator[Store]:
    """A pressure run of another worker holds s1's lease for the block (ended after it)."""
    store = Store.from_url(db_url)
    try:
        held = await store.claim("s1", owner="w", trigger=RunCause.PRESSURE, lease_s=60)
        assert isinstance(held, Claim)
        yield store
        await store.finish("s1", run_id=held.run_id, fence=held.fence,
                           end=RunEnd(outcome=RunStatus.NOTHING_TO_DO))
    finally:
        await store.close()


async def test_instructions_over_the_bound_are_refused_and_nothing_is_queued(
        api: Served, db_url: str) -> None:
    await _session(api)
    too_long = "x" * (MAX_INSTRUCTION_CHARS + 1)
    refused = await api.http.post("/v1/sessions/s1/compact", headers=A,
                                  json={"instructions": too_long})
    assert refused.status_code == 422, refused.text
    body = refused.json()
    assert body["field"] == "body.instructions"
    assert f"at most {MAX_INSTRUCTION_CHARS}" in body["message"]
    agent = await api.http.post("/v1/sessions/s1/compact_context", headers=A,
                                json={"focus": too_long})
    assert agent.status_code == 422 and agent.json()["field"] == "body.focus"
    # Nothing was marked: the next request queues a task of its own, with only its text.
    queued = await api.http.post("/v1/sessions/s1/compact", headers=A,
                                 json={"instructions": "keep the plan"})
    assert queued.status_code == 202
    assert await _held(db_url, queued.json()["task_id"]) == ("keep the plan",)


async def test_coalesced_requests_give_the_run_every_distinct_instruction(
        api: Served, db_url: str) -> None:
    await _session(api)
    first = await api.http.post("/v1/sessions/s1/compact", headers=A,
                                json={"instructions": "focus on the migration"})
    second = await api.http.post("/v1/sessions/s1/compact", headers=A, json={})
    third = await api.http.post("/v1/sessions/s1/compact_context", headers=A,
                                json={"focus": "keep the failing test's name"})
    task_id = first.json()["task_id"]
    assert [r.status_code for r in (first, second, third)] == [202, 202, 202]
    assert {r.json()["task_id"] for r in (second, third)} == {task_id}
    held = await _held(db_url, task_id)
    assert held == ("focus on the migration", "keep the failing test's name")

    outcome = await _run(api, task_id, held)
    assert outcome.outcome == "committed", outcome
    store = Store.from_url(db_url)
    try:
        [run] = await store.runs_for_task(task_id)
        [end] = await store.read_events("s1", kinds=[JournalKind.END])
        [summary] = await store.read_events("s1", kinds=[JournalKind.SUMMARY])
    finally:
        await store.close()
    assert run.instructions == list(held)
    assert end.payload["instructions"] == list(held)
    assert summary.payload["instructions"] == list(held)


async def test_an_agent_asking_again_and_again_is_refused_by_the_loop_guard(
        api: Served, db_url: str) -> None:
    await _session(api)
    tools = (await api.http.get("/v1/tools", headers=A)).json()
    assert "compact_context" in [t["name"] for t in tools["anthropic"]]
    asked = await api.http.post("/v1/sessions/s1/compact_context", headers=A,
                                json={"focus": "the schema plan"})
    assert asked.status_code == 202 and asked.json()["outcome"] == "queued"
    task_id = asked.json()["task_id"]
    outcome = await _run(api, task_id, await _held(db_url, task_id))
    assert outcome.outcome == "committed"
    # The runtime's next read of the surface has the checkpoint, as after any run.
    surface = (await api.http.get("/v1/sessions/s1/surface", headers=A)).json()
    assert any((m.get("meta") or {}).get("checkpoint") for m in surface["messages"])

    again = await api.http.post("/v1/sessions/s1/compact_context", headers=A,
                                json={"focus": "the schema plan"})
    assert again.status_code == 429, again.text
    assert again.json()["error"] == "refused"
    assert "compact_context refused" in again.json()["message"]
    assert "loop guard allows 1" in again.json()["message"]
    # Refused before anything was queued: no mark holds a task for the session.
    store = Store.from_url(db_url)
    try:
        assert await store.mark_manual("s1", "probe", ttl_s=120) == "probe"
    finally:
        await store.close()


async def test_the_agent_s_runs_are_counted_however_many_automatic_runs_came_after_them(
        api: Served, db_url: str) -> None:
    await _session(api)
    asked = await api.http.post("/v1/sessions/s1/compact_context", headers=A,
                                json={"focus": "the schema plan"})
    task_id = asked.json()["task_id"]
    assert (await _run(api, task_id, await _held(db_url, task_id))).outcome == "committed"
    # The runtime's steps go on signalling: a pressure run holds the session and the next
    # ones find it busy, each a run row newer than the agent's.
    async with _pressure_run(db_url) as store:
        for _ in range(8):
            busy = await store.claim("s1", owner="w", trigger=RunCause.PRESSURE, lease_s=60)
            assert isinstance(busy, Busy)

    again = await api.http.post("/v1/sessions/s1/compact_context", headers=A,
                                json={"focus": "the schema plan"})
    assert again.status_code == 429, again.text
    assert "compacted on request 1 times" in again.json()["message"]


async def test_an_agent_s_request_that_found_the_session_busy_is_not_counted_as_a_compaction(
        api: Served, db_url: str) -> None:
    """The agent asks while an automatic run holds the session: its run ends ``busy``, having
    compacted nothing (its note waits for the next manual run). Asking again is not refused
    as if the session had been compacted on request."""
    await _session(api)
    async with _pressure_run(db_url):
        asked = await api.http.post("/v1/sessions/s1/compact_context", headers=A,
                                    json={"focus": "the schema plan"})
        task_id = asked.json()["task_id"]
        outcome = await _run(api, task_id, await _held(db_url, task_id))
        assert outcome.failure_class == "busy"

    again = await api.http.post("/v1/sessions/s1/compact_context", headers=A,
                                json={"focus": "the schema plan, again"})
    assert again.status_code == 202, again.text


async def test_a_request_coalesces_into_a_queued_task_until_its_mark_is_older_than_the_ttl(
        db_url: str, tmp_path: Path) -> None:
    """A lost task (its message never reached a worker) holds the session's manual mark for
    ``worker.signal_ttl_s``: requests meanwhile are that task; the next one gets its own."""
    config = api_config(db_url, tmp_path, cpu_processes=1, worker={"signal_ttl_s": 0.5})
    async for api in serve_app(config):
        await _session(api)
        asked = [await api.http.post("/v1/sessions/s1/compact", headers=A, json={})
                 for _ in range(2)]
        assert [r.status_code for r in asked] == [202, 202], asked[-1].text
        lost = asked[0].json()["task_id"]
        assert asked[1].json()["task_id"] == lost
        await asyncio.sleep(0.6)
        again = await api.http.post("/v1/sessions/s1/compact", headers=A, json={})
        assert again.status_code == 202, again.text
        assert again.json()["task_id"] != lost


async def test_a_request_after_a_lost_task_s_mark_went_stale_is_queued_whatever_it_carried(
        db_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A queued manual task whose message never reached a worker (a broker outage) leaves its
    mark, with the instructions of every request coalesced into it, until the mark is stale.
    The next request takes the mark over with a task of its own, and carries what fits of
    those instructions beside its own: it is never refused because a lost task's mark is
    full."""
    config = api_config(db_url, tmp_path, cpu_processes=1, worker={"signal_ttl_s": 0.5})
    async for api in serve_app(config):
        await _session(api)
        asked = [await api.http.post("/v1/sessions/s1/compact", headers=A,
                                     json={"instructions": f"note {i}"})
                 for i in range(MAX_INSTRUCTIONS)]
        assert [r.status_code for r in asked] == [202] * MAX_INSTRUCTIONS
        lost = asked[0].json()["task_id"]
        assert {r.json()["task_id"] for r in asked} == {lost}
        await asyncio.sleep(0.6)  # the lost task's mark is stale

        again = await api.http.post("/v1/sessions/s1/compact_context", headers=A,
                                    json={"focus": "the handoff note"})
        assert again.status_code == 202, again.text
        assert again.json()["task_id"] != lost
        held = await _held(db_url, again.json()["task_id"])
        assert held[-1] == "the handoff note" and len(held) == MAX_INSTRUCTIONS
        assert held[:-1] == tuple(f"note {i}" for i in range(1, MAX_INSTRUCTIONS))
    # The text that gave way is named in the log, not dropped silently.
    [dropped] = [r for r in caplog.records
                 if getattr(r, "action", None) == "manual.instructions_dropped"]
    assert '["note 0"]' in dropped.getMessage()
