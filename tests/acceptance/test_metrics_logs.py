"""A mixed run on real worker processes, then what operations see of it: the worker's Prometheus
endpoint and its log lines.

One worker (``w1``, metrics on a free port) takes the pressure queue: two sessions that commit a
summary, one that pruning alone relieves, one whose every candidate answers whitespace. A second
worker (``w2``) takes the urgent queue, claims a session, hangs in its model call and is killed;
the lease expires and ``w1`` reaps it. The expected values come from the scenario and, for token
sums and model attempts, from the database (the truth the metrics must agree with).
"""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from compactd.scheduler.samples import WORDS, coding_session
from compactd.storage.kinds import JournalKind
from compactd.storage.records import RunRecord, utcnow
from tests.support.fake_provider import Behaviour, FakeProvider
from tests.support.metrics import scrape, value
from tests.support.probes import free_port, query
from tests.support.services import empty_database, flush_redis
from tests.support.stack import Stack, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.redis]

POLICY = {"trigger": [{"type": "tokens", "value": 4000}],
          "keep": {"type": "messages", "value": 6}, "model_name": "fake-gpt"}
LEASE_S = 5.0
# Planted in every session: prompt text, and (the fake lists ticket-like ids it reads) text of
# the provider's response. Neither may reach the logs.
MARKER = "QUOKKA-7731"
API_KEY = "sk-fake-test-key"
COMMITS = ("commit-a", "commit-b")
PRUNE_ONLY = "prune-only"
FAILS = "fails"
ABANDONED = "abandoned"


def _with_marker(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = list(messages)
    out.insert(4, {"role": "user", "content": f"Remember the escrow code {MARKER}; it is secret."})
    return out


def _prune_only_messages() -> list[dict[str, Any]]:
    """One huge tool result early on: cutting it brings the session under its trigger."""
    rng = random.Random(11)
    big = "\n".join(" ".join(rng.choice(WORDS) for _ in range(12)) for _ in range(1500))
    return _with_marker([
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "Show me the ledger dump."},
        {"role": "assistant", "content": "Dumping it.", "tool_calls": [
            {"id": "call_dump", "type": "function",
             "function": {"name": "bash", "arguments": "{\"command\": \"dump\"}"}}]},
        {"role": "tool", "tool_call_id": "call_dump", "name": "bash", "content": big},
        {"role": "assistant", "content": "The dump is above."},
        {"role": "user", "content": "Thanks. Which entries are off?"},
        {"role": "assistant", "content": "Entries 12 and 40 round early."},
        {"role": "user", "content": "Fix them."},
    ])


def _runs(url: str, session: str) -> list[RunRecord]:
    return query(url, lambda store: store.session_runs(session))


def _finished(url: str, session: str) -> RunRecord | None:
    runs = _runs(url, session)
    return runs[0] if runs and runs[0].finished else None


@dataclass
class Mixed:
    stack: Stack
    port: int
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float]
    runs: dict[str, list[RunRecord]]
    events: dict[str, list[Any]]
    log_lines: list[dict[str, Any]] = field(default_factory=list)
    raw_log: str = ""


@pytest.fixture(scope="module")
def mixed(pg_schema: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[Mixed]:
    asyncio.run(empty_database(pg_schema))
    flush_redis(redis_url)
    port = free_port()
    with FakeProvider() as fake, Stack(
            pg_schema, redis_url, tmp_path_factory.mktemp("mixed"), fake_url=fake.url,
            summarization=POLICY, worker={"lease_s": LEASE_S, "local_fallback": False}) as stack:
        for i, sid in enumerate(COMMITS):
            stack.ingest(sid, _with_marker(coding_session(steps=20, big_output_lines=30,
                                                          seed=20 + i).messages))
        stack.ingest(PRUNE_ONLY, _prune_only_messages())
        stack.ingest(FAILS, _with_marker(coding_session(steps=20, big_output_lines=30,
                                                        seed=30).messages))
        # Under its trigger, so the reaper does not enqueue it again (a manual run ignores it).
        stack.ingest(ABANDONED, coding_session(steps=8, big_output_lines=30, seed=40).messages)
        stack.start_worker("w1", concurrency=4,
                           queues=("compaction.pressure", "compaction.bulk"),
                           env={"COMPACTD_METRICS_PORT": str(port)})
        stack.start_worker("w2", concurrency=2, queues=("compaction.urgent",))
        url = pg_schema

        # Commits and the prune-only run, through pressure signals (automatic runs).
        for sid in (*COMMITS, PRUNE_ONLY):
            assert stack.cli_json("signal", sid)["enqueued"], sid
        for sid in (*COMMITS, PRUNE_ONLY):
            wait_until(lambda sid=sid: _finished(url, sid), timeout=90, what=f"{sid}'s run")

        # The summary failure: whitespace from the only candidate (no local fallback).
        fake.script(Behaviour(model="fake-gpt", output="whitespace", times=-1))
        assert stack.cli_json("signal", FAILS)["enqueued"]
        wait_until(lambda: _finished(url, FAILS), timeout=90, what="the failing run")
        fake.reset()

        # The abandoned lease: w2 claims, hangs in the model call, dies; w1 reaps.
        fake.script(Behaviour(model="fake-gpt", hang=True, times=1))
        stack.cli("compact", ABANDONED)
        wait_until(lambda: any(r.behaviour == "hang" for r in fake.requests), timeout=60,
                   what="w2's model call")
        stack.kill("w2")
        wait_until(lambda: query(url, lambda s: s.get_session(ABANDONED)).lease_expires_at
                   < utcnow(), timeout=LEASE_S + 30, what="the dead worker's lease to expire")
        subprocess.run([sys.executable, "-m", "celery", "-A", "compactd.worker.app", "call",
                        "compaction.reap"], env=stack.env, cwd=stack.home, check=True,
                       capture_output=True, timeout=60)
        wait_until(lambda: value(scrape(port), "compactd_lease_reaps_total") >= 1, timeout=60,
                   what="w1 to reap the lease")

        samples = scrape(port)
        sessions = (*COMMITS, PRUNE_ONLY, FAILS, ABANDONED)
        runs = {sid: _runs(url, sid) for sid in sessions}
        events = {sid: query(url, lambda s, sid=sid: s.read_events(
            sid, kinds=[JournalKind.PRUNE, JournalKind.SUMMARY])) for sid in sessions}
        raw = stack.log("w1")
        lines = [json.loads(line) for line in raw.splitlines() if line.startswith("{")]
        yield Mixed(stack, port, samples, runs, events, lines, raw)


def test_metrics_after_a_mixed_run_show_each_counter(mixed: Mixed) -> None:
    s, runs = mixed.samples, mixed.runs
    # The scenario did what it says: the database agrees before the metrics are read.
    for sid in COMMITS:
        assert [(r.status, r.failure_class) for r in runs[sid]] == [("committed", None)]
        assert runs[sid][0].stages and "summary" in runs[sid][0].stages["stages"]
    assert runs[PRUNE_ONLY][0].stages["stages"] == ["prune"]
    assert [(r.status, r.failure_class) for r in runs[FAILS]] == [("failed", "summary")]
    assert [(r.status, r.failure_class) for r in runs[ABANDONED]] == [("failed", "abandoned")]

    # Compactions by outcome and failure class (w1 ran four; w2's run was never counted by w2,
    # and is counted as a reap by w1).
    total = sum(v for (name, _), v in s.items() if name == "compactd_compactions_total")
    assert total == 4
    assert value(s, "compactd_compactions_total", outcome="committed", failure_class="",
                 trigger="pressure") == 3
    assert value(s, "compactd_compactions_total", outcome="failed", failure_class="summary",
                 trigger="pressure") == 1
    assert value(s, "compactd_prune_only_runs_total") == 1
    assert value(s, "compactd_lease_reaps_total") == 1
    assert value(s, "compactd_loop_guard_flags_total") == 0
    assert value(s, "compactd_runs_in_flight") == 0

    # Model calls by candidate and error kind, as the runs recorded them.
    attempts = [c for sid in (*COMMITS, FAILS) for r in runs[sid] for c in r.candidates or ()]
    failures = [c for c in attempts if c.get("kind")]
    assert [(c["candidate"], c["kind"]) for c in failures] == [("fake-gpt", "empty")]
    assert value(s, "compactd_model_failures_total", candidate="fake-gpt", kind="empty") == 1
    assert value(s, "compactd_model_latency_seconds_count", candidate="fake-gpt") == len(attempts)
    summaries = [e for sid in COMMITS for e in mixed.events[sid] if e.kind == JournalKind.SUMMARY]
    assert value(s, "compactd_fallback_depth_count") == len(attempts) - len(failures) >= 2
    assert value(s, "compactd_fallback_depth_sum") == 0

    # Tokens: before (every claimed run), after (committed runs), saved (the journal's sums).
    claimed = [r for sid in (*COMMITS, PRUNE_ONLY, FAILS) for r in runs[sid]]
    assert value(s, "compactd_tokens_before_count") == 4
    assert value(s, "compactd_tokens_before_sum") == sum(r.tokens_before or 0 for r in claimed)
    committed = [r for r in claimed if r.status == "committed"]
    assert value(s, "compactd_tokens_after_count") == 3
    assert value(s, "compactd_tokens_after_sum") == sum(r.tokens_after or 0 for r in committed)
    pruned = sum(e.payload["saved"] for sid in mixed.events for e in mixed.events[sid]
                 if e.kind == JournalKind.PRUNE)
    summarized = sum(e.payload["replaced_tokens"] - e.payload["tokens"] for e in summaries)
    assert pruned > 5000 and summarized > 0
    assert value(s, "compactd_tokens_saved_total", stage="prune") == pruned
    assert value(s, "compactd_tokens_saved_total", stage="summary") == summarized

    # Queue wait for every compaction.run w1 took; compactions per session at each summary commit.
    assert value(s, "compactd_queue_wait_seconds_count", queue="compaction.pressure") == 4
    assert value(s, "compactd_session_compactions_count") == 2


def test_every_log_line_of_a_run_carries_its_ids_and_no_secrets(mixed: Mixed) -> None:
    lines = mixed.log_lines
    assert lines, "the worker logged nothing as JSON"
    # One style: everything after Celery's start-up banner is a JSON line.
    body = mixed.raw_log[mixed.raw_log.index("{"):]
    assert all(line.startswith("{") for line in body.splitlines() if line.strip())
    for sid in (*COMMITS, PRUNE_ONLY, FAILS):
        (run,) = mixed.runs[sid]
        mine = [line for line in lines if line.get("run_id") == run.id]
        assert {line.get("session_id") for line in mine} == {sid}
        assert {line.get("task_id") for line in mine} == {run.task_id}
        end = [line for line in mine if line.get("action") == "compaction.end"]
        assert len(end) == 1 and end[0]["outcome"] == run.status
        # Celery's own lines about this task: every one after "received" carries the run too.
        celery = [line for line in lines
                  if (line.get("data") or {}).get("id") == run.task_id]
        received = [line for line in celery if line["logger"] == "celery.worker.strategy"]
        finished = [line for line in celery if line["logger"] == "celery.app.trace"]
        assert len(received) == 1 and len(finished) == 1, celery
        assert finished[0]["run_id"] == run.id and finished[0]["session_id"] == sid
        if sid == FAILS:
            assert finished[0]["level"] == "error"
            assert "CompactionFailed('summary: " in finished[0]["msg"]
            fallback = [line for line in mine if line["logger"] == "compactd.worker.llm.fallback"]
            assert fallback and all(line["run_id"] == run.id for line in fallback)
        else:
            assert "succeeded" in finished[0]["msg"]
    reap = [line for line in lines if line.get("action") == "reap"]
    assert [(line["session_id"], line["run_id"]) for line in reap] == [
        (ABANDONED, mixed.runs[ABANDONED][0].id)]
    # No key, no prompt text, no provider response body: not at INFO, not at all.
    assert API_KEY not in mixed.raw_log
    assert MARKER not in mixed.raw_log
    summary = next(e.payload["text"] for e in mixed.events[COMMITS[0]]
                   if e.kind == JournalKind.SUMMARY)
    assert MARKER in summary, "the fake's summary was meant to echo the marker"
    for section_line in summary.splitlines():
        if len(section_line) > 40:
            assert section_line not in mixed.raw_log


def test_the_metrics_port_comes_from_the_environment(mixed: Mixed) -> None:
    started = [line for line in mixed.log_lines if line.get("action") == "metrics.serve"]
    assert [line["port"] for line in started] == [mixed.port]
