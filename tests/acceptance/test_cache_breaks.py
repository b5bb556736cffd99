"""Model-free edits break the agent's prefix cache only when it pays, through a real Celery
worker on PostgreSQL: a small clearing waits for the next summary and lands in its commit, a
large one commits alone, a cold cache lets a small one commit alone, and an overflow run is
never held back."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from compactd.scheduler.client import Client
from compactd.scheduler.samples import coding_session
from compactd.storage.kinds import JournalKind
from compactd.storage.records import EventRecord, RunRecord
from compactd.worker.settings import load_config
from tests.support.probes import query
from tests.support.stack import Stack, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.redis]

MakeStack = Callable[..., Stack]

# The sample session is about 3,400 tokens: over the clearing's trigger, under the summary's.
# Clearing every tool result but the newest frees about 2,000 tokens; the summary keeps the
# last 12 messages, so some cleared results lie after its range and ride beside it.
POLICY: dict[str, Any] = {
    "model_name": "fake-gpt", "trigger": [{"type": "tokens", "value": 5000}],
    "keep": {"type": "messages", "value": 12},
    "clear_tool_uses": {"enabled": True, "trigger": 2000, "keep": 1}}
SMALL = 100_000  # a clear_at_least every edit here is under
LARGE = 500  # a clear_at_least the clearing here is over


def _runs(stack: Stack, session: str) -> list[RunRecord]:
    return query(stack.database_url, lambda store: store.session_runs(session))


def _journal(stack: Stack, session: str) -> list[EventRecord]:
    return query(stack.database_url, lambda store: store.read_events(
        session, kinds=[JournalKind.PRUNE, JournalKind.SUMMARY]))


def _finished_runs(stack: Stack, session: str, count: int) -> list[RunRecord]:
    def done() -> list[RunRecord]:
        runs = _runs(stack, session)
        return runs if len(runs) >= count and all(r.finished for r in runs) else []
    return wait_until(done, timeout=90, what=f"{count} finished run(s) of {session}")


def _cleared(stack: Stack, session: str) -> list[dict[str, Any]]:
    return [m for m in stack.cli_json("surface", session)["messages"]
            if m["role"] == "tool" and str(m["content"]).startswith("[cleared]")]


def _start(make_stack: MakeStack, **policy: Any) -> Stack:
    stack = make_stack(summarization={**POLICY, **policy})
    stack.ingest("s1", coding_session(steps=12, big_output_lines=30).messages)
    stack.start_worker("w1", concurrency=2)
    return stack


@pytest.mark.parametrize("layout", ["merge", "recallable"])
def test_a_small_clearing_waits_for_the_summary_and_rides_in_its_commit(
        make_stack: MakeStack, fake: Any, layout: str) -> None:
    stack = _start(make_stack, clear_at_least=SMALL, layout=layout)
    version = stack.cli_json("surface", "s1")["version"]
    assert stack.cli_json("signal", "s1")["enqueued"]
    [held] = _finished_runs(stack, "s1", 1)
    assert held.status == "nothing_to_do" and "clear_at_least" in (held.error or ""), held
    # Nothing committed alone: the agent's surface is as it was, its cache intact.
    surface = stack.cli_json("surface", "s1")
    assert surface["version"] == version and not _cleared(stack, "s1"), surface
    assert _journal(stack, "s1") == [] and fake.requests == []

    # The runtime's next step puts the session over the summary trigger.
    with Client(load_config(env=stack.env)) as client:
        step = client.create_session("s1", run_model="fake-gpt").append(
            [{"role": "user", "content": "Now write the report. " + "detail " * 2000}])
    assert step.fired and step.signalled, step
    runs = _finished_runs(stack, "s1", 2)
    assert [r.status for r in runs] == ["committed", "nothing_to_do"], runs
    assert runs[0].stages is not None and runs[0].stages["stages"] == ["prune", "summary"]
    journal = _journal(stack, "s1")
    prunes = [e for e in journal if e.kind == JournalKind.PRUNE]
    [summary] = [e for e in journal if e.kind == JournalKind.SUMMARY]
    assert prunes, journal
    # One commit: every entry written by the summary's transaction, at its instant.
    assert {e.created_at for e in prunes} == {summary.created_at}, journal
    messages = stack.cli_json("surface", "s1")["messages"]
    checkpoint = max(i for i, m in enumerate(messages) if (m.get("meta") or {}).get("checkpoint"))
    cleared = _cleared(stack, "s1")
    assert cleared and all(messages.index(m) > checkpoint for m in cleared), messages
    assert stack.cli_json("verify", "s1")["ok"]


@pytest.mark.parametrize(("policy", "idle_s"), [
    pytest.param({"clear_at_least": LARGE}, 0.0, id="it-frees-enough"),
    # No append for longer than the cache lives: the agent re-sends everything anyway.
    pytest.param({"clear_at_least": SMALL, "cache_ttl_s": 1}, 1.5, id="the-cache-is-cold"),
])
def test_a_clearing_commits_alone_when_it_frees_enough_or_the_cache_is_cold(
        make_stack: MakeStack, fake: Any, policy: dict[str, Any], idle_s: float) -> None:
    stack = _start(make_stack, **policy)
    time.sleep(idle_s)
    assert stack.cli_json("signal", "s1")["enqueued"]
    [run] = _finished_runs(stack, "s1", 1)
    assert run.status == "committed" and run.stages is not None, run
    assert run.stages["stages"] == ["prune"], run.stages
    assert len(_cleared(stack, "s1")) > 3 and fake.requests == []


def test_an_overflow_run_commits_a_small_clearing_before_its_summary(
        make_stack: MakeStack, fake: Any) -> None:
    stack = _start(make_stack, clear_at_least=SMALL)
    with Client(load_config(env=stack.env)) as client:
        overflow = client.get_session("s1").report_overflow(timeout_s=90)
    assert overflow.compacted and overflow.run is not None, overflow
    assert overflow.run["stages"] == ["prune", "summary"], overflow.run
    journal = _journal(stack, "s1")
    prunes = [e for e in journal if e.kind == JournalKind.PRUNE]
    [summary] = [e for e in journal if e.kind == JournalKind.SUMMARY]
    # Its own commit, ahead of the summary call: relief first, whatever the cache costs.
    assert prunes and all(e.created_at < summary.created_at for e in prunes), journal
    assert fake.requests, "the summary was written by the fake model"
    assert any((m.get("meta") or {}).get("checkpoint")
               for m in stack.cli_json("surface", "s1")["messages"])
