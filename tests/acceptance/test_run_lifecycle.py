"""A run's lifecycle tells the truth: what a worker, the CLI and the client report about a run is
what it committed, and every run ends within its deadline.

Real processes: ``celery -A compactd.worker.app worker`` subprocesses and the CLI against real
PostgreSQL and Redis, the fake provider over HTTP.
"""

from __future__ import annotations

import asyncio
import json
import math
import sqlite3
import subprocess
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import asyncpg
import pytest
import yaml

from compactd.scheduler.client import CompactdClient
from compactd.scheduler.samples import coding_session
from compactd.storage.errors import ConfigError, SessionNotFound
from compactd.storage.leads import ALL_POOLS
from compactd.storage.messages import parse_openai
from compactd.storage.store import Store
from compactd.worker.enqueue import RunRequest
from compactd.worker.settings import load_config
from tests.conftest import REPO, compactd_cmd, run_cli
from tests.support.db import Db
from tests.support.fake_provider import Behaviour, FakeProvider
from tests.support.metrics import scrape, value
from tests.support.probes import free_port
from tests.support.stack import FAKE_KEY_ENV, Stack, fake_models, wait_until
from tests.support.worker_stack import POLICY, db, enqueuer

pytestmark = pytest.mark.slow
__all__ = ["db"]  # the fixture (tests/support/worker_stack.py)

MakeStack = Callable[..., Stack]

# Renewals back to back: one is in flight whenever the run commits, and every await after the
# commit (the loop guard's read) gives the next one a turn. Nothing else claims these sessions.
TINY_LEASE_S = 0.003


def run_ends(stack: Stack, worker: str) -> list[dict[str, Any]]:
    """The worker's ``compaction.end`` log lines: what it reported for each run."""
    lines = [json.loads(line) for line in stack.log(worker).splitlines()
             if line.startswith("{")]
    return [line for line in lines if line.get("action") == "compaction.end"]


# ------------------------------------------------------------------------------------------
# item 8: the renewer stops before the run's ending commit


def test_a_committed_run_is_reported_committed_while_renewals_race_it(
        make_stack: MakeStack, db: Db) -> None:
    sessions = [f"r{i}" for i in range(12)]
    stack = make_stack(summarization=POLICY, worker={"lease_s": TINY_LEASE_S})
    for i, sid in enumerate(sessions):
        db.ingest(sid, coding_session(steps=20, big_output_lines=30, seed=300 + i).messages)
    stack.start_worker("w1", concurrency=2)
    with enqueuer(stack) as enq:
        for sid in sessions:
            enq.send(RunRequest(sid, "pressure"))
        wait_until(lambda: len(run_ends(stack, "w1")) >= len(sessions), timeout=90,
                   what="every run to end")
    for sid in sessions:
        [run] = db.runs(sid)
        assert run.status == "committed", run
        assert db.session(sid).lease_run_id is None
    reported = [(e["outcome"], e["failure_class"]) for e in run_ends(stack, "w1")]
    assert reported == [("committed", None)] * len(sessions), reported
    assert "CompactionFailed" not in stack.log("w1")

    # The CLI's own runs (inline: its exit status is the outcome it saw).
    for i in range(3):
        db.ingest(f"cli{i}", coding_session(steps=20, big_output_lines=30,
                                            seed=390 + i).messages)
        out = stack.cli("compact", f"cli{i}", "--inline", "--json", check=False)
        result = json.loads(out.stdout)
        assert (out.returncode, result["outcome"]) == (0, "committed"), result


# ------------------------------------------------------------------------------------------
# item 16: summarization.lease_s is refused, naming where the lease is configured


def test_summarization_lease_s_is_refused_naming_worker_lease_s(
        cli_env: dict[str, str], tmp_path: Path) -> None:
    config = tmp_path / "compactd.yaml"
    config.write_text(yaml.safe_dump({"summarization": {"lease_s": 120}}))
    out = run_cli({**cli_env, "COMPACTD_CONFIG": str(config)}, "status", check=False)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "summarization.lease_s" in out.stderr and "worker.lease_s" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr

    # A session's own policy cannot set it either (the same parser), and nothing is created.
    async def create() -> None:
        config = load_config({"COMPACTD_HOME": str(tmp_path)})
        async with CompactdClient(config) as client:
            with pytest.raises(ConfigError, match=r"policy\.lease_s.*worker\.lease_s"):
                await client.create_session("s1", policy={"lease_s": 5})
            with pytest.raises(SessionNotFound):
                await client.get_session("s1")

    asyncio.run(create())

    # The example configuration sets the lease where it is read, and only there.
    example = yaml.safe_load((REPO / "ops" / "compactd.example.yaml").read_text())
    assert "lease_s" not in example["summarization"]
    assert example["worker"]["lease_s"] == 60


# ------------------------------------------------------------------------------------------
# item 17: a run ends by its deadline, cleanly, even when the database makes it wait

DEADLINE_S = 3.0
TIME_LIMIT_S = 12.0  # the finish after a cancelled run gets half of what lies beyond the deadline
LOCK_HELD_S = 4.5


def assert_cancelled_cleanly(run: Any, journal_ends: list[Any], *, lease: str | None,
                             deadline_s: float = DEADLINE_S, limit_s: float = TIME_LIMIT_S
                             ) -> None:
    assert (run.status, run.failure_class) == ("failed", "cancelled"), run
    assert "deadline" in (run.error or ""), run.error
    took = (run.finished_at - run.started_at).total_seconds()
    assert took < deadline_s + min(10, (limit_s - deadline_s) / 2) + 2, took
    assert lease is None, "the lease is released"
    [end] = [e for e in journal_ends if e.run_id == run.id]
    assert (end.payload["outcome"], end.payload["failure_class"]) == ("failed", "cancelled")


@pytest.mark.timed
def test_a_run_held_past_its_deadline_by_a_lock_ends_cancelled(
        make_stack: MakeStack, fake: FakeProvider, db: Db, clean_pg: str) -> None:
    stack = make_stack(summarization=POLICY,
                       worker={"deadline_s": DEADLINE_S, "task_time_limit_s": TIME_LIMIT_S})
    db.ingest("d1", coding_session(steps=20, big_output_lines=30, seed=500).messages)
    before = db.surface("d1")
    fake.latency_s = 1.0
    stack.start_worker("w1", concurrency=2)

    async def hold_the_row() -> None:
        conn = await asyncpg.connect(clean_pg)
        try:
            async with conn.transaction():
                await conn.execute("SELECT 1 FROM sessions WHERE id = 'd1' FOR UPDATE")
                await asyncio.sleep(LOCK_HELD_S)
        finally:
            await conn.close()

    with enqueuer(stack) as enq:
        enq.send(RunRequest("d1", "pressure"))
        wait_until(lambda: fake.requests, timeout=30, what="the run's model call")
        # The summary comes back in a second; its commit then waits on this lock, past the
        # run's deadline. Without a bound it would wait for the lock and commit.
        asyncio.run(hold_the_row())
        run = wait_until(lambda: next((r for r in db.runs("d1") if r.finished), None),
                         timeout=30, what="the run to end")
    assert_cancelled_cleanly(run, db.events("d1", ["compaction/end"]),
                             lease=db.session("d1").lease_run_id)
    after = db.surface("d1")
    assert (after.version, [n.seq for n in after.nodes]) == (
        before.version, [n.seq for n in before.nodes]), "the session is as it was"
    assert db.verify("d1").ok
    reported = [(e["outcome"], e["failure_class"]) for e in run_ends(stack, "w1")]
    assert reported == [("failed", "cancelled")], reported


@pytest.mark.timed
def test_an_inline_run_on_sqlite_held_past_its_deadline_ends_cancelled(
        fake: FakeProvider, cli_env: dict[str, str], tmp_path: Path) -> None:
    # Longer than the worker's: the CLI imports the SDK on its first model call.
    deadline_s, limit_s = 8.0, 30.0
    config = tmp_path / "compactd.yaml"
    config.write_text(yaml.safe_dump({
        "models": fake_models(fake.url), "summarization": POLICY,
        "worker": {"deadline_s": deadline_s, "task_time_limit_s": limit_s,
                   "metrics_port": 0}}))
    env = {**cli_env, "COMPACTD_CONFIG": str(config), FAKE_KEY_ENV: "sk-fake-test-key"}
    path = tmp_path / "d2.jsonl"
    path.write_text("".join(json.dumps(m) + "\n" for m in coding_session(
        steps=20, big_output_lines=30, seed=501).messages))
    run_cli(env, "ingest", str(path), "--session", "d2", "--run-model", "fake-gpt")
    # The test's own reads go to the file directly: the run is the CLI's, what it left is not.
    database = tmp_path / "compactd.sqlite3"

    async def read() -> tuple[Any, list[Any], list[Any], str | None]:
        store = Store.from_url(f"sqlite:///{database}")
        try:
            runs = await store.session_runs("d2")
            ends = await store.read_events("d2", kinds=["compaction/end"])
            session = await store.get_session("d2")
            return await store.read_surface("d2"), runs, ends, session.lease_run_id
        finally:
            await store.close()

    before, *_ = asyncio.run(read())
    fake.latency_s = 1.0
    proc = subprocess.Popen([*compactd_cmd(), "compact", "d2", "--inline", "--json"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: fake.requests, timeout=30, what="the run's model call")
        _, [running], _, _ = asyncio.run(read())
        lock = sqlite3.connect(database, isolation_level=None)
        lock.execute("BEGIN IMMEDIATE")  # the write lock, as another writer holds it
        # Held until the run's deadline, counted from its start, is a second behind: the
        # summary (back a second after the call) waits on it to commit, past the deadline.
        past_deadline = running.started_at.timestamp() + deadline_s + 1.0
        time.sleep(max(0.0, past_deadline - time.time()))
        lock.execute("ROLLBACK")
        lock.close()
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    result = json.loads(stdout)
    assert proc.returncode == 1, stdout + stderr
    assert (result["outcome"], result["failure_class"]) == ("failed", "cancelled"), result
    after, [run], ends, lease = asyncio.run(read())
    assert after == before, "the session is as it was"
    assert run.id == running.id
    assert_cancelled_cleanly(run, ends, lease=lease, deadline_s=deadline_s, limit_s=limit_s)


# ------------------------------------------------------------------------------------------
# item 12: overflow reports the prunes a failed run committed


async def test_overflow_after_a_durable_prune_reports_the_smaller_surface(
        make_stack: MakeStack, fake: FakeProvider, db: Db) -> None:
    # A trigger nothing reaches: only the overflow report compacts. Every summary is refused
    # and there is no local fallback, so the run fails after its prunes committed.
    stack = make_stack(summarization={**POLICY, "trigger": [{"type": "tokens",
                                                             "value": 1_000_000}]},
                       worker={"local_fallback": False})
    fake.script(Behaviour(output="whitespace", times=-1))
    db.ingest("o1", coding_session(steps=10, big_output_lines=200, seed=600).messages)
    before = db.session("o1")
    stack.start_worker("w1", concurrency=2)
    async with CompactdClient(load_config(env=stack.env)) as client:
        handle = await client.get_session("o1")
        result = await handle.report_overflow(timeout_s=60)
    after = db.session("o1")
    assert result.run is not None
    # Partial: its prunes committed, then the summary failed.
    assert (result.run["outcome"], result.run["failure_class"]) == ("partial", "summary")
    assert result.run["stages"] == ["prune"], result.run
    assert after.surface_tokens < before.surface_tokens, "the prunes are durable"
    assert result.compacted, result.reason
    assert "summary" in result.reason, result.reason
    assert result.version == after.surface_version > before.surface_version
    assert result.pruned == result.run["pruned"] > 0
    assert result.tokens_after == after.surface_tokens + after.envelope_tokens
    assert result.messages is not None and len(result.messages) == after.surface_messages


# ------------------------------------------------------------------------------------------
# item 11: provider usage is recorded per run, per summary, in status and in metrics


def test_provider_usage_is_stored_shown_and_exported_for_both_sdks(
        make_stack: MakeStack, fake: FakeProvider, db: Db) -> None:
    cached = {"fake-gpt": 64, "fake-claude": 32}
    # u-refused: fake-claude's whitespace answer is refused (and billed), fake-gpt writes it.
    fake.script(Behaviour(model="fake-claude", output="whitespace", cached_tokens=32),
                *(Behaviour(model=m, cached_tokens=n, times=-1) for m, n in cached.items()))
    stack = make_stack(claude=True, summarization=POLICY, worker={"local_fallback": False})
    port = free_port()
    # session: (run model, summary model); fake-gpt speaks OpenAI, fake-claude Anthropic.
    sessions = {"u-refused": ("fake-gpt", "fake-claude"), "u-gpt": ("fake-gpt", "fake-gpt"),
                "u-claude": ("fake-claude", "fake-claude")}
    for i, (sid, (run_model, summary_model)) in enumerate(sessions.items()):
        db.ingest(sid, coding_session(steps=20, big_output_lines=30, seed=700 + i).messages,
                  run_model=run_model, policy={"model_name": summary_model})
    stack.start_worker("w1", concurrency=2, env={"COMPACTD_METRICS_PORT": str(port)})
    totals: dict[tuple[str, str], int] = {}
    usages: dict[str, dict[str, Any]] = {}
    for sid in sessions:
        seen = len(fake.requests)
        result = stack.cli_json("compact", sid, "--wait")
        assert result["outcome"] == "committed", result
        calls = fake.requests[seen:]
        expected: dict[str, dict[str, int]] = {}
        for r in calls:
            mine = expected.setdefault(r.model or "", {"calls": 0, "input_tokens": 0,
                                                       "cached_tokens": 0})
            mine["calls"] += 1
            mine["input_tokens"] += math.ceil(r.body_bytes / 4)
            mine["cached_tokens"] += cached[r.model or ""]
        usage = result["usage"]
        by = usage["by_candidate"]
        assert {m: {k: by[m][k] for k in e} for m, e in expected.items()} == expected, usage
        for kind in ("calls", "input_tokens", "cached_tokens", "output_tokens"):
            assert usage[kind] == sum(c[kind] for c in by.values()), (kind, usage)
            for model, counts in by.items():
                totals[model, kind] = totals.get((model, kind), 0) + counts[kind]
        assert all(c["output_tokens"] > 0 for c in by.values()), usage

        [run] = stack.cli_json("status", sid)["runs"]
        assert run["usage"] == usage
        [summary] = db.events(sid, ["compaction/summary"])
        assert summary.payload["usage"] == usage, "one step: the summary's calls are the run's"
        usages[sid] = usage
    # The refused answer was billed too, and counts under its candidate.
    assert set(usages["u-refused"]["by_candidate"]) == {"fake-gpt", "fake-claude"}
    scraped = scrape(port)
    for model in cached:
        for kind in ("input", "cached", "output"):
            assert value(scraped, "compactd_model_tokens_total", candidate=model,
                         kind=kind) == totals[model, f"{kind}_tokens"], (model, kind)


# ------------------------------------------------------------------------------------------
# issue 26 item 12: a billed answer refused while it is read, or cut at its cap, keeps its usage

# Fake output -> the failure kind the worker records; each billed by the provider.
BILLED_REFUSALS = {"tool_calls": "non_text", "reasoning_only": "non_text", "refusal": "refused",
                   "content_filter": "refused", "truncated": "truncated"}


def test_billed_answers_refused_while_read_or_cut_at_the_cap_keep_their_usage(
        make_stack: MakeStack, fake: FakeProvider, db: Db) -> None:
    # fake-gpt speaks OpenAI, fake-claude Anthropic: each goes first and fails, the other writes.
    other = {"fake-gpt": "fake-claude", "fake-claude": "fake-gpt"}
    # The Messages API has no content filter of its own: the fake answers it as a refusal.
    cases = [(first, output) for first in other for output in BILLED_REFUSALS
             if (first, output) != ("fake-claude", "content_filter")]
    stack = make_stack(claude=True, summarization=POLICY, worker={"local_fallback": False})
    # The cases run at once: each session's summarized span carries its own marker, which its
    # scripted answers match (and keep the bodies of, so each case finds its own two requests).
    for i, (first, output) in enumerate(cases):
        sid = f"{first}-{output}"
        messages = coding_session(steps=20, big_output_lines=30, seed=800 + i).messages
        ticket = next(m for m in messages if m["role"] == "user" and "Ticket" in m["content"])
        ticket["content"] = f"{_case_marker(sid)} {ticket['content']}"
        db.ingest(sid, messages, run_model=other[first], policy={"model_name": first})
        fake.script(Behaviour(model=first, output=output, contains=_case_marker(sid),
                              keep_body=True),
                    Behaviour(model=other[first], contains=_case_marker(sid), keep_body=True))
    port = free_port()
    stack.start_worker("w1", concurrency=len(cases), env={"COMPACTD_METRICS_PORT": str(port)})

    with ThreadPoolExecutor(len(cases)) as pool:
        results = dict(zip(cases, pool.map(lambda sid: stack.cli_json("compact", sid, "--wait"),
                                           [f"{f}-{o}" for f, o in cases]), strict=True))
    totals: dict[tuple[str, str], int] = {}
    for (first, output), result in results.items():
        sid = f"{first}-{output}"
        assert (result["outcome"], result["model"]) == ("committed", other[first]), result
        # The run as stored, which `status` shows (the usage test above checks that it does).
        [stored] = db.runs(sid)
        assert result["usage"] == stored.usage, (result, stored)
        assert [(c["candidate"], c["kind"]) for c in stored.candidates or () if c.get("kind")
                ] == [(first, BILLED_REFUSALS[output])], stored.candidates
        refused, written = [r for r in fake.requests
                            if r.body is not None and _case_marker(sid) in json.dumps(r.body)]
        assert (refused.model, refused.behaviour) == (first, output), refused
        assert written.model == other[first], written
        usage = result["usage"]
        by = usage["by_candidate"]
        assert set(by) == {first, other[first]}, usage
        assert by[first]["calls"] == 1, by
        assert by[first]["input_tokens"] == refused.input_tokens > 0, by
        assert by[first]["output_tokens"] == refused.output_tokens > 0, by
        assert usage["calls"] == 2 and usage["input_tokens"] == (
            refused.input_tokens + written.input_tokens), usage
        for model, counts in by.items():
            for kind in ("input_tokens", "output_tokens"):
                totals[model, kind] = totals.get((model, kind), 0) + counts[kind]
    assert not fake.pending_script(), "every case's answers were asked for"
    scraped = scrape(port)
    for model in other:
        for kind in ("input", "output"):
            assert value(scraped, "compactd_model_tokens_total", candidate=model,
                         kind=kind) == totals[model, f"{kind}_tokens"], (model, kind)


def _case_marker(sid: str) -> str:
    return f"[case {sid}]"


# ------------------------------------------------------------------------------------------
# issue 26 item 10: a candidate that hangs is skipped by the runs after it, on every worker


def test_a_hanging_candidate_is_skipped_by_the_next_run_on_another_worker(
        make_stack: MakeStack, fake: FakeProvider, db: Db) -> None:
    # fake-gpt (the summary model) hangs; fake-claude (the run model) answers. One failure
    # opens the circuit, and the cool-down outlasts the test.
    fake.script(Behaviour(model="fake-gpt", hang=True, times=-1))
    stack = make_stack(claude=True, summarization=POLICY,
                       worker={"local_fallback": False, "candidate_budget_s": 3,
                               "breaker": {"failures": 1, "cooldown_s": 600}})
    for i, sid in enumerate(("h1", "h2")):
        db.ingest(sid, coding_session(steps=20, big_output_lines=30, seed=900 + i).messages,
                  run_model="fake-claude", policy={"model_name": "fake-gpt"})

    stack.start_worker("w1", concurrency=2)
    first = stack.cli_json("compact", "h1", "--wait")
    assert (first["outcome"], first["model"]) == ("committed", "fake-claude"), first
    [run] = stack.cli_json("status", "h1")["runs"]
    assert [(c["candidate"], c["kind"]) for c in run["candidates"]] == [
        ("fake-gpt", "timeout")], run["candidates"]
    stack.stop("w1")

    # Another worker process: what the first learned reaches it through Redis.
    stack.start_worker("w2", concurrency=2)
    hung = len(fake.requests_for(model="fake-gpt"))
    second = stack.cli_json("compact", "h2", "--wait")
    assert (second["outcome"], second["model"]) == ("committed", "fake-claude"), second
    assert len(fake.requests_for(model="fake-gpt")) == hung == 1, "not asked again"
    [run] = stack.cli_json("status", "h2")["runs"]
    [skipped] = run["candidates"]
    assert (skipped["candidate"], skipped["kind"], skipped["http_attempts"]) == (
        "fake-gpt", "circuit_open", 0), skipped
    assert skipped["reason"].startswith("circuit open: 1 failed calls in a row"), skipped
    assert "circuit open" in stack.cli("status", "h2").stdout


# ------------------------------------------------------------------------------------------
# a run that committed a round and then failed says both


def test_a_run_that_fails_after_committing_a_round_ends_partial_everywhere(
        make_stack: MakeStack, fake: FakeProvider, db: Db) -> None:
    # Each round summarizes what fits the summarizer's budget (shrink), so one round cannot
    # relieve the session: the first round's checkpoint commits, the second round's call is
    # refused (400: no retry) and nothing closes the candidate list.
    fake.script(Behaviour(model="fake-gpt"), Behaviour(model="fake-gpt", status=400, times=-1))
    stack = make_stack(summarization={**POLICY, "strategy": "shrink",
                                      "trim_tokens_to_summarize": 2000},
                       worker={"local_fallback": False})
    port = free_port()
    db.ingest("p1", coding_session(steps=40, big_output_lines=30, seed=800).messages)
    before = db.session("p1")
    stack.start_worker("w1", concurrency=2, env={"COMPACTD_METRICS_PORT": str(port)})
    out = stack.cli("compact", "p1", "--wait", "--json", check=False)
    result = json.loads(out.stdout)
    cause = "committed 1 summary round, then failed: "
    assert (result["outcome"], result["failure_class"]) == ("partial", "summary"), result
    # Not success: DESIGN.md's status for a failed compaction, the outcome naming it partial.
    assert out.returncode == 1, out.stderr
    assert "a partial one too" in " ".join(stack.cli("compact", "--help").stdout.split())
    assert result["error"].startswith(cause), result
    after = db.session("p1")
    assert after.surface_tokens < before.surface_tokens
    assert [n.kind for n in db.surface("p1").nodes].count("checkpoint") == 1
    [run] = stack.cli_json("status", "p1")["runs"]
    assert (run["status"], run["failure_class"]) == ("partial", "summary"), run
    assert run["error"].startswith(cause)
    [end] = db.events("p1", ["compaction/end"])
    assert (end.payload["outcome"], end.payload["failure_class"]) == ("partial", "summary")
    fleet = stack.cli_json("status")
    assert fleet["runs"]["partial"] == {"summary": 1}, fleet["runs"]
    assert fleet["runs"]["failed"] == {}, fleet["runs"]
    assert value(scrape(port), "compactd_compactions_total", outcome="partial",
                 failure_class="summary", trigger="manual") == 1
    # Celery's state for the task is SUCCESS: the run row and its result say partial.
    ended = [line for line in stack.log("w1").splitlines()
             if "celery.app.trace" in line and run["run_id"] in line]
    assert ended and "succeeded" in ended[0], ended
    assert "CompactionFailed" not in stack.log("w1")


@pytest.mark.timed
def test_a_partial_pressure_run_is_timed_to_its_checkpoint_and_followed_up(
        make_stack: MakeStack, fake: FakeProvider, db: Db) -> None:
    # As above, on a signal: the first round's checkpoint commits, the second round's call is
    # refused after 3 s (and every later call at once). The agent had its checkpoint before the
    # failure: the pressure-to-checkpoint wait is observed up to it; appends made while the run
    # held the signal mark are followed up as after a committed run.
    fake.script(Behaviour(model="fake-gpt"),
                Behaviour(model="fake-gpt", status=400, latency_s=3.0),
                Behaviour(model="fake-gpt", status=400, times=-1))
    # clear_at_least 0: the first round frees less than the default's worth of a cache break
    # (the kept tail holds the session over this small trigger), and this is about what a
    # partial run reports, not whether its first summary pays (test_low_trigger.py).
    stack = make_stack(summarization={**POLICY, "strategy": "shrink",
                                      "trim_tokens_to_summarize": 2000, "clear_at_least": 0},
                       worker={"local_fallback": False})
    port = free_port()
    db.ingest("p1", coding_session(steps=40, big_output_lines=30, seed=800).messages)
    stack.start_worker("w1", concurrency=2, env={"COMPACTD_METRICS_PORT": str(port)})
    signalled = time.monotonic()
    assert stack.cli_json("signal", "p1")["enqueued"]
    wait_until(lambda: len(fake.requests_for(model="fake-gpt")) >= 2, timeout=60,
               what="the second round's call")
    checkpointed = time.monotonic()
    db.run(lambda s: s.append("p1", [parse_openai({"role": "user", "content": "more"})]))
    runs = wait_until(lambda: (r := db.runs("p1")) and len(r) >= 2 and r, timeout=60,
                      what="the follow-up run")
    assert (runs[0].status, runs[0].failure_class) == ("partial", "summary"), runs[0]
    assert runs[1].trigger == "pressure"
    samples = scrape(port)
    assert value(samples, "compactd_pressure_to_checkpoint_seconds_count",
                 trigger="pressure") == 1
    took = value(samples, "compactd_pressure_to_checkpoint_seconds_sum", trigger="pressure")
    # Not the partial run's end, 3 s after the second call was received.
    assert 0 < took <= checkpointed - signalled
    # And the lead the appends fire by learnt it, measured the same way.
    lead = db.run(lambda s: s.read_leads([ALL_POOLS]))[ALL_POOLS]
    assert (lead.source, lead.runs) == ("auto", 1), lead
    assert 0 < lead.lead_s <= checkpointed - signalled


# ------------------------------------------------------------------------------------------
# a worker that crashed leaves no lease behind its restart


@pytest.mark.timed
def test_a_worker_started_after_a_crash_releases_the_dead_workers_leases_at_once(
        make_stack: MakeStack, fake: FakeProvider, db: Db) -> None:
    # The run's summary call hangs and its worker is killed: its lease (the default 60 s) would
    # hold the session until it expired and the reaper came.
    fake.script(Behaviour(model="fake-gpt", hang=True))
    stack = make_stack(summarization=POLICY)
    db.ingest("k1", coding_session(steps=20, big_output_lines=30, seed=900).messages)
    stack.start_worker("w1", concurrency=2)
    with enqueuer(stack) as enq:
        enq.send(RunRequest("k1", "pressure"))
    wait_until(lambda: fake.requests_for(model="fake-gpt"), timeout=30, what="the summary call")
    assert db.session("k1").lease_run_id is not None
    stack.kill("w1")
    started = time.monotonic()
    stack.start_worker("w2", concurrency=2)  # the same host
    wait_until(lambda: db.session("k1").lease_run_id is None, timeout=30,
               what="the dead worker's lease released")
    print(f"\nreleased {time.monotonic() - started:.2f} s after the restart began")
    cut = db.runs("k1")[0]
    assert (cut.status, cut.failure_class) == ("failed", "abandoned"), cut
    assert "at its start (process gone)" in (cut.error or ""), cut
    assert "released the lease of a worker process that is gone" in stack.log("w2")
    # Still over its trigger: sent again, as the reaper would.
    [again] = wait_until(lambda: [r for r in db.runs("k1") if r.status == "committed"],
                         timeout=30, what="k1 compacted again")
    assert again.trigger == "reap", again
