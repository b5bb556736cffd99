"""Documented keys that no other test showed acting: each test writes the key into the config
file, runs real worker processes against PostgreSQL, Redis and the fake provider over HTTP, and
sees what the key changes (with its default, each of these tests fails)."""

from __future__ import annotations

import asyncio
import itertools
import json
import sys
from collections.abc import Callable
from typing import Any

import pytest

from compactd.scheduler.samples import coding_session
from compactd.storage.kinds import NodeKind, RunCause
from compactd.storage.records import Claim
from compactd.worker.compaction.render import checkpoint_parts
from compactd.worker.enqueue import RunRequest
from tests.support.db import Db
from tests.support.fake_provider import Behaviour, FakeProvider
from tests.support.locks import session_row_locked
from tests.support.stack import Stack, wait_until
from tests.support.worker_stack import POLICY, db, enqueuer

pytestmark = pytest.mark.slow
__all__ = ["db"]  # the fixture (tests/support/worker_stack.py)

MakeStack = Callable[..., Stack]


def test_a_candidates_attempts_and_its_retry_after_wait_are_the_configured_ones(
        make_stack: MakeStack, fake: FakeProvider, db: Db) -> None:
    # Every call is rate-limited with a Retry-After far beyond the cap: the candidate is asked
    # max_attempts times, each retry waiting the cap, well within the candidate's budget. With
    # the defaults (4 attempts, a 20 s cap) the first wait would outlast the budget.
    fake.script(Behaviour(model="fake-gpt", status=429, retry_after=30, times=-1))
    stack = make_stack(summarization={**POLICY, "model_name": None},
                       worker={"local_fallback": False, "max_attempts": 2,
                               "retry_after_cap_s": 0.5, "candidate_budget_s": 10})
    db.ingest("r1", coding_session(steps=20, big_output_lines=30, seed=41).messages)
    stack.start_worker("w1", concurrency=2)
    result = stack.cli_json("compact", "r1", "--wait", check=False)
    assert (result["outcome"], result["failure_class"]) == ("failed", "summary"), result
    [run] = stack.cli_json("status", "r1")["runs"]
    assert [(c["candidate"], c["http_attempts"]) for c in run["candidates"]] == [
        ("fake-gpt", 2)], run["candidates"]
    first, second = (r.received_at for r in fake.requests_for(model="fake-gpt"))
    assert second - first >= 0.5, "the retry did not wait the capped Retry-After"


def test_the_provider_rate_spaces_every_model_call_of_every_worker(
        make_stack: MakeStack, fake: FakeProvider, db: Db) -> None:
    # Summaries of several budget-sized calls each (share_cache off: one shared call would
    # read the whole range), six runs at once on two worker processes: every call of them
    # takes its slot on the one meter in Redis.
    rate = 4.0
    stack = make_stack(summarization={**POLICY, "share_cache": False,
                                      "trim_tokens_to_summarize": 2000},
                       worker={"provider_rate_per_s": rate})
    sessions = [f"p{i}" for i in range(6)]
    for i, sid in enumerate(sessions):
        db.ingest(sid, coding_session(steps=20, big_output_lines=30, seed=500 + i).messages)
    stack.start_worker("w1", concurrency=4)
    stack.start_worker("w2", concurrency=4)
    with enqueuer(stack) as enq:
        for sid in sessions:
            enq.send(RunRequest(sid, RunCause.MANUAL))
        wait_until(lambda: all(r.finished for sid in sessions for r in db.runs(sid))
                   and all(db.runs(sid) for sid in sessions), timeout=120,
                   what="every run to end")
    runs = [r for sid in sessions for r in db.runs(sid)]
    assert {r.status for r in runs} == {"committed"}, [(r.status, r.error) for r in runs]
    times = sorted(r.received_at for r in fake.requests)
    assert len(times) > len(sessions), "each summary takes several calls"
    # The meter's slots are a little wider than 1/rate apart; a call that left its slot late
    # brings the next one closer, never into the same slot.
    assert (len(times) - 1) / (times[-1] - times[0]) <= rate
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert min(gaps) >= 0.5 / rate, sorted(gaps)[:5]
    assert sum((r.stages or {}).get("rate_wait_s", 0) for r in runs) > 0


def test_max_rounds_bounds_the_rounds_of_one_run(
        make_stack: MakeStack, fake: FakeProvider, db: Db) -> None:
    # Each round summarizes what fits the summarizer's budget (shrink), so one round cannot
    # bring the session under its trigger: the default would go on for up to three rounds.
    stack = make_stack(summarization={**POLICY, "strategy": "shrink",
                                      "trim_tokens_to_summarize": 2000, "max_rounds": 1})
    db.ingest("m1", coding_session(steps=40, big_output_lines=30, seed=800).messages)
    stack.start_worker("w1", concurrency=2)
    result = stack.cli_json("compact", "m1", "--wait")
    assert result["outcome"] == "committed", result
    [run] = db.runs("m1")
    assert (run.stages or {}).get("rounds") == 1, run.stages
    assert len(fake.requests_for(model="fake-gpt")) == 1
    assert db.session("m1").surface_tokens > 3000, "one round was enough: the test shows nothing"


SKILL_TEXT = "---\nname: pdf-tools\ndescription: Read and fill PDF forms.\n---\n# PDF tools\n"


def _skill_read(call_id: str, tool_name: str, path: str) -> list[dict[str, Any]]:
    call = {"id": call_id, "type": "function",
            "function": {"name": tool_name, "arguments": json.dumps({"path": path})}}
    return [{"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call_id, "content": SKILL_TEXT}]


def test_skill_reads_are_found_by_the_configured_tool_names_and_skills_path(
        make_stack: MakeStack, fake: FakeProvider, db: Db) -> None:
    # The runtime loads skills with its own tool from its own folder; a read by a default tool
    # name, or from the default folder, is not one of its skills.
    stack = make_stack(summarization={**POLICY, "skill_file_read_tool_names": ["open_file"],
                                      "skills_path": "/opt/agent-skills"})
    messages = coding_session(steps=20, big_output_lines=30, seed=77).messages
    head = [*messages[:4],
            *_skill_read("k1", "open_file", "/opt/agent-skills/pdf/SKILL.md"),
            *_skill_read("k2", "read_file", "/opt/agent-skills/csv/SKILL.md"),
            *_skill_read("k3", "open_file", "/mnt/skills/xlsx/SKILL.md")]
    db.ingest("k", [*head, *messages[4:]])
    stack.start_worker("w1", concurrency=2)
    result = stack.cli_json("compact", "k", "--wait")
    assert result["outcome"] == "committed", result
    [checkpoint] = [n for n in db.surface("k").nodes if n.kind == NodeKind.CHECKPOINT]
    _summary, skills = checkpoint_parts(checkpoint.message)
    assert [(s.name, s.path) for s in skills] == [("pdf-tools", "/opt/agent-skills/pdf/SKILL.md")]


def test_the_redis_url_shares_the_circuits_when_the_broker_is_not_redis(
        make_stack: MakeStack, fake: FakeProvider, db: Db, clean_redis: str) -> None:
    # The embedded broker (a directory) carries the tasks; COMPACTD_REDIS_URL alone is what
    # lets a circuit opened by one worker process reach the next.
    fake.script(Behaviour(model="fake-gpt", status=500, times=-1))
    stack = make_stack(summarization=POLICY,
                       worker={"max_attempts": 1, "breaker": {"failures": 1, "cooldown_s": 600}},
                       extra_env={"COMPACTD_BROKER_URL": "filesystem://",
                                  "COMPACTD_REDIS_URL": clean_redis})
    for i, sid in enumerate(("b1", "b2")):
        db.ingest(sid, coding_session(steps=20, big_output_lines=30, seed=60 + i).messages,
                  run_model="fake-mini")
    stack.start_worker("w1", concurrency=2)
    first = stack.cli_json("compact", "b1", "--wait")
    assert (first["outcome"], first["model"]) == ("committed", "fake-mini"), first
    stack.stop("w1")
    stack.start_worker("w2", concurrency=2)
    second = stack.cli_json("compact", "b2", "--wait")
    assert (second["outcome"], second["model"]) == ("committed", "fake-mini"), second
    assert len(fake.requests_for(model="fake-gpt")) == 1, "asked again by the second worker"
    [run] = stack.cli_json("status", "b2")["runs"]
    assert [(c["candidate"], c["kind"]) for c in run["candidates"]] == [
        ("fake-gpt", "circuit_open")], run["candidates"]


def _levels(stack: Stack, name: str) -> set[str]:
    return {json.loads(line)["level"] for line in stack.log(name).splitlines()
            if line.startswith("{")}


def test_a_worker_logs_at_the_environments_level_unless_its_command_line_gives_one(
        make_stack: MakeStack) -> None:
    stack = make_stack(extra_env={"COMPACTD_LOG_LEVEL": "DEBUG"})
    stack.start("plain", [sys.executable, "-m", "celery", "-A", "compactd.worker.app", "worker",
                          "-n", "plain@%h", "-Q", "compaction.urgent", "--concurrency", "2",
                          "--without-gossip", "--without-mingle"])
    wait_until(lambda: "ready" in stack.log("plain"), timeout=30, what="the worker to be ready")
    assert "debug" in _levels(stack, "plain")
    # The stack's workers are started with -l INFO, which wins.
    stack.start_worker("given", concurrency=2)
    assert "debug" not in _levels(stack, "given")


def test_the_default_model_writes_the_summary_when_the_sessions_own_models_fail(
        make_stack: MakeStack, fake: FakeProvider, db: Db) -> None:
    fake.script(Behaviour(model="fake-gpt", status=500, times=-1))
    stack = make_stack(summarization={**POLICY, "model_name": None}, default_model="fake-mini",
                       worker={"local_fallback": False, "max_attempts": 1})
    db.ingest("d1", coding_session(steps=20, big_output_lines=30, seed=90).messages)
    stack.start_worker("w1", concurrency=2)
    result = stack.cli_json("compact", "d1", "--wait")
    assert (result["outcome"], result["model"]) == ("committed", "fake-mini"), result


@pytest.mark.timed
def test_a_task_stuck_past_its_runs_deadline_frees_its_slot_at_the_task_time_limit(
        make_stack: MakeStack, fake: FakeProvider, db: Db, clean_pg: str) -> None:
    # Another transaction holds h1's row: the claim gives up at the run's deadline, and then
    # the end of the automatic run (clearing its signal) waits on the row with no deadline of
    # its own. Only the task's limit ends that wait, freeing the worker's one slot for h2's
    # run while h1's row is still held; with the default limit h2 would wait minutes.
    stack = make_stack(summarization=POLICY, worker={"deadline_s": 2, "task_time_limit_s": 5})
    for i, sid in enumerate(("h1", "h2")):
        db.ingest(sid, coding_session(steps=20, big_output_lines=30, seed=70 + i).messages)
    stack.start_worker("w1", concurrency=1)

    async def while_h1_is_held() -> str:
        async with session_row_locked(clean_pg, "h1"):
            with enqueuer(stack) as enq:
                stuck = enq.send(RunRequest("h1", RunCause.PRESSURE))
                await asyncio.to_thread(
                    wait_until, lambda: f"compaction.run[{stuck}] received" in stack.log("w1"),
                    timeout=30, what="h1's task to start")
                enq.send(RunRequest("h2", RunCause.MANUAL))
            await asyncio.to_thread(
                wait_until, lambda: any(r.status == "committed" for r in db.runs("h2")),
                timeout=20, what="h2's run to commit while h1's row is held")
            return stuck

    stuck = asyncio.run(while_h1_is_held())
    ended = stack.task_ended("w1", stuck)
    assert ended is not None and ended["data"]["exc"] == "TimeoutError()", ended
    assert db.runs("h1") == [], "h1's claim never got the row"


@pytest.mark.timed
def test_a_worker_keeps_its_lease_while_it_runs_and_loses_it_lease_s_after_it_stalls(
        make_stack: MakeStack, fake: FakeProvider, db: Db) -> None:
    # w1 takes the manual runs, w2 the reaper's ticks and what they send again. A summary
    # slower than the lease commits: renewals kept the lease. A worker stopped in the middle
    # of a call renews nothing: the reaper ends its run once the lease is over, and the other
    # worker compacts the session. The default lease would hold it past the test's wait.
    stack = make_stack(summarization=POLICY,
                       worker={"lease_s": 1.5, "reap_interval_s": 0.25,
                               "sweep_interval_s": 3600})
    for i, sid in enumerate(("slow", "stalled")):
        db.ingest(sid, coding_session(steps=20, big_output_lines=30, seed=110 + i).messages)
    stack.start_beat()
    stack.start_worker("w1", concurrency=1, queues=("compaction.urgent",))
    stack.start_worker("w2", concurrency=2, queues=("compaction.pressure",))
    wait_until(lambda: "beat: Starting" in stack.log("beat"), timeout=30, what="beat to start")
    fake.script(Behaviour(model="fake-gpt", latency_s=4.0, times=1))
    with enqueuer(stack) as enq:
        enq.send(RunRequest("slow", RunCause.MANUAL))
        [slow] = wait_until(lambda: [r for r in db.runs("slow") if r.finished], timeout=30,
                            what="the slow run to end")
        assert (slow.status, slow.error) == ("committed", None), slow
        fake.script(Behaviour(model="fake-gpt", hang=True, times=1))
        enq.send(RunRequest("stalled", RunCause.MANUAL))
        wait_until(lambda: len(fake.requests) == 2, timeout=30, what="the call that hangs")
    with stack.paused("w1"):
        again = wait_until(lambda: [r for r in db.runs("stalled") if r.status == "committed"],
                           timeout=15, what="the stalled worker's session compacted again")
    assert again[0].trigger == "reap", again
    [stopped] = [e for e in db.events("stalled", ["compaction/end"])
                 if e.payload["failure_class"] == "abandoned"]
    assert stopped.payload["closed_by"] == "reaper", stopped.payload


def test_without_a_keep_a_run_keeps_retain_ratio_of_the_run_models_window(
        make_stack: MakeStack, fake: FakeProvider, db: Db) -> None:
    # No keep: the run keeps the newest messages within retain_ratio of the session's window,
    # a tail well under what the default ratio would keep.
    window, ratio = 20_000, 0.05
    policy = {k: v for k, v in POLICY.items() if k != "keep"}
    # A fraction trigger: a tokens trigger would be under the default ratio of fake-gpt's own
    # window, which the load refuses.
    stack = make_stack(summarization={**policy, "trigger": [{"type": "fraction", "value": 0.2}],
                                      "retain_ratio": ratio})
    db.ingest("t1", coding_session(steps=20, big_output_lines=30, seed=120).messages,
              context_window=window)
    stack.start_worker("w1", concurrency=2)
    result = stack.cli_json("compact", "t1", "--wait")
    assert result["outcome"] == "committed", result
    tail = [n for n in db.surface("t1").nodes if n.kind != NodeKind.CHECKPOINT]
    assert tail, "nothing was kept"
    assert sum(n.tokens for n in tail) <= ratio * window, [(n.seq, n.tokens) for n in tail]


@pytest.mark.timed
def test_a_bulk_item_that_finds_its_session_leased_is_sent_again_within_the_workers_lease(
        make_stack: MakeStack, fake: FakeProvider, db: Db) -> None:
    # Another run holds the session for a few seconds: the item is tried again every third to
    # two thirds of the worker's lease, and compacts once that lease is over. After a default
    # lease, its first retry would come after the job's wait has given up.
    stack = make_stack(summarization=POLICY, worker={"lease_s": 1.5})
    db.ingest("b1", coding_session(steps=20, big_output_lines=30, seed=130).messages)
    stack.start_worker("w1", concurrency=2)
    held = db.run(lambda s: s.claim("b1", owner="another", trigger="pressure", lease_s=4))
    assert isinstance(held, Claim), held
    out = stack.cli("recompact", "--force", "--timeout", "15", "--json", check=False,
                    timeout=60)
    assert out.returncode == 0, out.stderr
    job = json.loads(out.stdout)["job"]
    assert (job["done"], job["failed"], job["pending"]) == (1, 0, 0), job
    assert "retry: Retry in" in stack.log("w1"), "the item never found the session leased"
