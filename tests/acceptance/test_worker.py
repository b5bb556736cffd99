"""The worker with real processes: ``celery -A compactd.worker.app worker`` subprocesses, real Redis
and PostgreSQL, the fake provider over HTTP.

Sessions are seeded and inspected through the store directly (``tests.support.db``): a CLI
subprocess per step would cost a second each. Runs are enqueued the way the scheduler does
(``Enqueuer``), or through the CLI where the CLI is what the acceptance line names.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from compactd.scheduler.samples import coding_session
from compactd.storage.kinds import NodeKind
from compactd.storage.messages import Message
from compactd.storage.records import RunRecord
from compactd.storage.store import Store
from compactd.worker.enqueue import RunRequest
from tests.support.db import Db
from tests.support.fake_provider import Behaviour, FakeProvider
from tests.support.private_redis import PrivateRedis
from tests.support.stack import Stack, openai_models, wait_until
from tests.support.worker_stack import db, enqueuer

pytestmark = pytest.mark.slow
__all__ = ["db"]  # the fixture (tests/support/worker_stack.py)

MakeStack = Callable[..., Stack]

POLICY = {"trigger": [{"type": "tokens", "value": 8000}], "keep": {"type": "messages",
                                                                     "value": 6},
          "model_name": "fake-gpt"}
# One summarizer call per run (the range fits the input budget), so a run is one model call
# long and the tests can hold or slow exactly that call.
ONE_CALL = {"keep": {"type": "messages", "value": 6}, "model_name": "fake-gpt",
            "trim_tokens_to_summarize": 16000}


def finished_run(db: Db, task_id: str) -> RunRecord | None:
    runs = [r for r in db.run(lambda s: s.runs_for_task(task_id)) if r.finished]
    return runs[-1] if runs else None


def checkpoint_count(db: Db, session_id: str) -> tuple[int, int]:
    """(checkpoint events in the log, checkpoint nodes on the surface)."""
    journal = db.journal(session_id)
    surface = db.surface(session_id)
    return (journal[NodeKind.CHECKPOINT],
            sum(1 for n in surface.nodes if n.kind == NodeKind.CHECKPOINT))


def settle(db: Db, session_id: str, *, quiet_s: float = 1.0, timeout: float = 60.0) -> None:
    """Wait until no run holds or waits for the session: no lease, no pending signal (a
    committed automatic run signals again at once when appends made meanwhile put the session
    back over its trigger), and nothing running, for ``quiet_s`` in a row."""
    quiet_since: list[float] = []

    def idle() -> bool:
        info = db.session(session_id)
        running = [r for r in db.runs(session_id) if not r.finished]
        if info.lease_run_id or info.signal_at or running:
            quiet_since.clear()
            return False
        if not quiet_since:
            quiet_since.append(time.monotonic())
        return time.monotonic() - quiet_since[0] >= quiet_s

    wait_until(idle, timeout=timeout, interval=0.1, what=f"session {session_id} to settle")


def assert_journal_closed(db: Db, session_id: str) -> None:
    """Every compaction/start has its compaction/end, and the log replays to the surface."""
    journal = db.journal(session_id)
    assert journal["compaction/start"] == journal["compaction/end"], journal
    verified = db.verify(session_id)
    assert verified.ok, verified.problems


# ------------------------------------------------------------------------------------------
# 1. two workers, one session


# `compactd compact s1 --wait --json`, run once a line arrives on stdin, after the imports.
_COMPACT_WHEN_TOLD = """
import sys
import compactd.scheduler.client, compactd.worker.enqueue
from compactd.scheduler.cli import main
sys.stdin.readline()
raise SystemExit(main(["compact", "s1", "--wait", "--json"]))
"""


def test_two_workers_one_session_exactly_one_commits(
        make_stack: MakeStack, fake: FakeProvider, db: Db) -> None:
    stack = make_stack(summarization=POLICY)
    # A summary call of 4.5 s (the run model summarizes in one call that shares the agent's
    # cache): the first run still holds its worker when the second message arrives, however
    # far apart the two CLI processes start.
    fake.latency_s = 4.5
    stack.ingest("s1", coding_session(steps=20, big_output_lines=30).messages)
    # One slot each: a worker busy with the first run cannot take the second (prefetch of one,
    # late acks), so each worker receives one of the two runs.
    stack.start_worker("w1", concurrency=1)
    stack.start_worker("w2", concurrency=1)
    # Started without -P: the configured threads pool is what runs.
    assert "concurrency: 1 (thread)" in stack.log("w1")
    def compact() -> subprocess.Popen[str]:
        # The command's process imports the CLI and what its `compact` loads, then waits for a
        # line on stdin: told to, it sends its request within milliseconds however loaded the
        # machine (a CLI's start alone took longer than the summary call on a busy CI run).
        return subprocess.Popen([sys.executable, "-c", _COMPACT_WHEN_TOLD], env=stack.env,
                                cwd=stack.home, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    procs = [compact(), compact()]
    # The second request comes once the first run has started: while it is queued, a second
    # manual request would be the same task (coalesced), not a second run.
    for i, proc in enumerate(procs):
        if i:
            wait_until(lambda: db.runs("s1"), timeout=60, what="the first run to start")
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.flush()
    results = [json.loads(p.communicate(timeout=120)[0]) for p in procs]
    outcomes = sorted((r["outcome"], r["failure_class"]) for r in results)
    assert outcomes.count(("committed", None)) == 1, outcomes
    other = next(o for o in outcomes if o != ("committed", None))
    assert other in (("failed", "busy"), ("nothing_to_do", None)), outcomes
    for name in ("w1", "w2"):
        received = [line for line in stack.log(name).splitlines()
                    if "Task compaction.run[" in line and "received" in line]
        assert len(received) == 1, f"{name} received {len(received)} runs"
    # The task's return value, which Celery renders for this line and for Flower's event, is
    # the outcome at a glance; the replaced seqs and the candidates stay in the run row.
    done = [line for name in ("w1", "w2") for line in stack.log(name).splitlines()
            if "Task compaction.run[" in line and "succeeded" in line]
    assert len(done) == 2 and all("'outcome': " in line for line in done), done
    assert not any("replaced_seqs" in line or "candidates" in line for line in done), done
    surface = stack.cli_json("surface", "s1")
    assert sum(1 for m in surface["messages"] if (m.get("meta") or {}).get("checkpoint")
               and m["role"] == "user") == 1
    journal = db.journal("s1")
    assert journal[NodeKind.CHECKPOINT] == 1, journal
    assert journal["compaction/summary"] == 1, journal
    assert_journal_closed(db, "s1")
    assert "1/1 sessions verified" in stack.cli("verify", "--all").stdout
    assert fake.requests_for(model="fake-gpt"), "the summary came from the configured model"


# ------------------------------------------------------------------------------------------
# 2. appends while a run is in flight


APPEND_RATE_PER_S = 200


def append_until(db: Db, session_id: str, task_id: str, *, per_s: float = APPEND_RATE_PER_S,
                 limit_s: float = 60.0, agents: int = 4) -> tuple[list[int], float]:
    """Append one message at a time on a schedule of ``per_s`` a second until the run of
    ``task_id`` has finished; the seqs appended (in seq order) and the rate achieved. A few
    appends may be in flight at once, so a slow machine still keeps the rate."""

    async def go(store: Store) -> tuple[list[int], float]:
        loop = asyncio.get_running_loop()
        started = loop.time()
        seqs: list[int] = []
        issued = 0
        done = asyncio.Event()

        async def agent() -> None:
            nonlocal issued
            while not done.is_set() and loop.time() - started < limit_s:
                i = issued
                issued += 1
                delay = started + i / per_s - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                text = f"append {i}: checking src/billing/tax.py again"
                message = (Message(role="user", content=text) if i % 2 == 0
                           else Message(role="assistant", content=text))
                seqs.append((await store.append(session_id, [message])).first_seq)

        async def watch() -> None:
            while not any(r.finished for r in await store.runs_for_task(task_id)):
                await asyncio.sleep(0.1)
            done.set()

        watcher = asyncio.create_task(watch())
        await asyncio.gather(*(agent() for _ in range(agents)))
        watcher.cancel()
        return sorted(seqs), len(seqs) / (loop.time() - started)

    return db.run(go, timeout=limit_s + 30)


def append_turns(db: Db, session_id: str, count: int) -> list[int]:
    """Append ``count`` short user/assistant messages at once; their seqs."""
    messages = [Message(role="user" if i % 2 == 0 else "assistant",
                        content=f"turn {i}: reading src/billing/invoice.py")
                for i in range(count)]
    result = db.run(lambda store: store.append(session_id, messages))
    seqs = list(range(result.first_seq, result.last_seq + 1))
    assert len(seqs) == count
    return seqs


@pytest.mark.timed
def test_appends_at_200_per_s_during_runs_all_land(
        make_stack: MakeStack, fake: FakeProvider, db: Db) -> None:
    """An automatic run, then a manual one, each with a 2 s model call and 200 appends/s to
    the same session meanwhile. Storage's commit checks the (position, seq) prefix through the
    replaced range, the fence, and that the replaced seqs are still one contiguous run, so both
    commit, with every appended message after the checkpoint."""
    stack = make_stack(summarization={**ONE_CALL,
                                      "trigger": [{"type": "tokens", "value": 3000}]})
    fake.latency_s = 2.0
    sample = coding_session(steps=20, big_output_lines=30).messages
    db.ingest("a1", sample)
    stack.start_worker("w1", concurrency=2)
    all_appended: list[int] = []
    with enqueuer(stack) as enq:
        for trigger in ("pressure", "manual"):
            if trigger == "manual":
                # The automatic follow-up may have summarized everything before its kept tail;
                # a few more turns give the manual run a range to select.
                all_appended += append_turns(db, "a1", 12)
            requests = len(fake.requests)
            task_id = enq.send(RunRequest("a1", trigger))
            wait_until(lambda: len(fake.requests) > requests  # noqa: B023
                       or finished_run(db, task_id) is not None,  # noqa: B023
                       timeout=30, what=f"the {trigger} run's model call")
            assert len(fake.requests) > requests, (
                f"the {trigger} run ended without a model call: {finished_run(db, task_id)}; "
                f"runs: {db.runs('a1')}")
            seqs, rate = append_until(db, "a1", task_id)
            all_appended += seqs
            run = finished_run(db, task_id)
            assert run is not None
            assert (run.status, run.failure_class) == ("committed", None), run
            assert rate >= APPEND_RATE_PER_S * 0.9, f"only {rate:.0f} appends/s"

            [summary] = [e for e in db.events("a1", ["compaction/summary"])
                         if e.run_id == run.id]
            during = [s for s in seqs if s < summary.seq]
            assert len(during) >= APPEND_RATE_PER_S, (
                f"only {len(during)} appends landed while the model call ran")
            nodes = db.surface("a1").nodes
            order = [n.seq for n in nodes]
            checkpoint = next(i for i, n in enumerate(nodes)
                              if n.kind == NodeKind.CHECKPOINT and n.seq > summary.seq)
            # Every message appended during the run is on the surface, in order, after the
            # checkpoint that run committed; nothing it replaced was appended after it started.
            assert order.index(seqs[0]) > checkpoint
            assert not set(summary.payload["replaced_seqs"]) & set(seqs)
            # A follow-up run may compact the appended messages in turn (they put the session
            # over its trigger again); let it finish before the journal is checked.
            settle(db, "a1")
            assert_journal_closed(db, "a1")
    journal = db.journal("a1")
    assert journal["message"] == len(sample) + len(all_appended)
    committed = [r for r in db.runs("a1") if r.status == "committed"]
    assert len(committed) >= 2
    assert journal[NodeKind.CHECKPOINT] == len(committed)
    assert "1/1 sessions verified" in stack.cli("verify", "a1").stdout
    # Every model call is one a run recorded, and none was a retry.
    attempts = [c for r in db.runs("a1") for c in r.candidates or ()]
    assert all(c["http_attempts"] <= 1 for c in attempts), attempts
    assert len(fake.requests) == sum(c["http_attempts"] for c in attempts)


# ------------------------------------------------------------------------------------------
# 3. kill -9 during a model call, looped


KILL_LOOPS = int(os.environ.get("COMPACTD_KILL_LOOPS", "20"))


def test_kill_9_during_model_call_is_reaped_and_recompacted(
        make_stack: MakeStack, fake: FakeProvider, db: Db) -> None:
    """The worker dies holding a model call; the lease expires, beat's reaper closes the run as
    abandoned and re-enqueues the session (still over its trigger: the prunes committed before
    the call do not relieve it), and the restarted worker compacts it. Looped."""
    lease_s = 2.0
    stack = make_stack(
        # clear_at_least 0: the prunes commit before the call however little they free.
        summarization={**ONE_CALL, "trigger": [{"type": "tokens", "value": 5000}],
                       "clear_at_least": 0},
        worker={"lease_s": lease_s, "reap_interval_s": 0.25, "sweep_interval_s": 3600},
        # The loop is bound by its worker starts, each importing every configured model's SDK.
        models=openai_models(fake.url))
    sessions = [f"k{i:02d}" for i in range(KILL_LOOPS)]
    for i, sid in enumerate(sessions):
        db.ingest(sid, coding_session(steps=10, big_output_lines=200, seed=100 + i,
                                      call_prefix=f"c{i}").messages)
    stack.start_beat()
    worker = stack.start_worker("w0", concurrency=4)
    with enqueuer(stack) as enq:
        for i, sid in enumerate(sessions):
            fake.script(Behaviour(model="fake-gpt", hang=True, times=1))
            requests = len(fake.requests)
            enq.send(RunRequest(sid, "pressure"))
            wait_until(lambda: len(fake.requests) > requests, timeout=30,  # noqa: B023
                       what=f"{sid}'s model call to hang")
            assert fake.requests[-1].behaviour == "hang"
            victim = [r for r in db.runs(sid) if r.status == "running"]
            assert len(victim) == 1, victim
            stack.kill(f"w{i}")
            assert worker.poll() is not None
            worker = stack.start_worker(f"w{i + 1}", concurrency=4)
            done = wait_until(lambda: [r for r in db.runs(sid)  # noqa: B023
                                       if r.status == "committed"],
                              timeout=60, what=f"{sid} to be compacted after the kill")
            runs = db.runs(sid)
            killed = next(r for r in runs if r.id == victim[0].id)
            assert (killed.status, killed.failure_class) == ("failed", "abandoned"), killed
            assert done[0].trigger == "reap", "the session was sent again for the dead run"
            ends = [e for e in db.events(sid, ["compaction/end"]) if e.run_id == killed.id]
            assert len(ends) == 1 and ends[0].payload["failure_class"] == "abandoned", ends
            # The reaper, or the restarted worker, which releases its host's dead leases.
            closed_by = ends[0].payload["closed_by"]
            assert closed_by == "reaper" or closed_by.endswith("(process gone)"), closed_by
            assert checkpoint_count(db, sid) == (1, 1), f"{sid}: one checkpoint"
            assert db.journal(sid)["compaction/prune"] >= 1, "the killed run's prunes stayed"
            assert_journal_closed(db, sid)
    # Later runs of earlier sessions (none expected) would show up here as extra checkpoints.
    for sid in sessions:
        assert checkpoint_count(db, sid) == (1, 1), sid
    out = stack.cli("verify", "--all")
    assert f"{KILL_LOOPS}/{KILL_LOOPS} sessions verified" in out.stdout, out.stdout


def test_an_operator_release_ends_the_task_as_a_success_not_a_failure(
        make_stack: MakeStack, fake: FakeProvider, db: Db) -> None:
    """``compactd lease release`` on a run that hangs on its model: the run ends abandoned (the
    record), and its task, which Flower shows from the worker's task events, succeeds with the
    release in its result instead of failing with CompactionFailed (an ERROR line and a FAILURE
    for an action the operator took on purpose)."""
    stack = make_stack(summarization={**ONE_CALL, "trigger": [{"type": "tokens", "value": 3000}]},
                       worker={"lease_s": 3.0, "sweep_interval_s": 3600})
    db.ingest("rel", coding_session(steps=20, big_output_lines=30, seed=7).messages)
    stack.start_worker("w1", concurrency=2)
    fake.script(Behaviour(model="fake-gpt", hang=True, times=1))
    with enqueuer(stack) as enq:
        enq.send(RunRequest("rel", "pressure"))
    wait_until(lambda: fake.requests, timeout=30, what="the run's model call to hang")
    [held] = [r for r in db.runs("rel") if r.status == "running"]
    out = stack.cli_json("lease", "release", "rel", "--run", held.id, "--by", "alice")
    assert out["released"] is True, out

    entry = wait_until(lambda: stack.task_ended("w1", held.task_id), timeout=60,
                       what="the held run's task to end")
    assert entry["level"] == "info" and " succeeded in " in entry["msg"], entry
    assert "'released_by': 'alice'" in entry["msg"], entry["msg"]
    assert "CompactionFailed" not in stack.log("w1")
    [run] = [r for r in db.runs("rel") if r.id == held.id]
    assert (run.status, run.failure_class) == ("failed", "abandoned"), run
    [end] = [e for e in db.events("rel", ["compaction/end"]) if e.run_id == held.id]
    assert end.payload["closed_by"] == "alice"
    assert_journal_closed(db, "rel")


# ------------------------------------------------------------------------------------------
# 4. every candidate returns whitespace


def test_every_candidate_returns_whitespace_fails_summary(
        make_stack: MakeStack, fake: FakeProvider, db: Db) -> None:
    """No prune applies to this session (no tool result over the threshold, no clearing), so
    the surface after the failed run must be byte-for-byte what it was."""
    stack = make_stack(claude=True, summarization=POLICY, worker={"local_fallback": False})
    fake.script(Behaviour(output="whitespace", times=-1))
    db.ingest("ws", coding_session(steps=20, big_output_lines=30).messages,
              run_model="fake-claude", context_window=200_000)
    before = stack.cli_json("surface", "ws")
    stack.start_worker("w1", concurrency=2)
    out = stack.cli("compact", "ws", "--wait", "--json", check=False)
    assert out.returncode == 1, out.stdout + out.stderr
    result = json.loads(out.stdout)
    assert (result["outcome"], result["failure_class"]) == ("failed", "summary"), result
    assert stack.cli_json("surface", "ws") == before
    journal = db.journal("ws")
    assert journal["compaction/prune"] == 0 and journal[NodeKind.CHECKPOINT] == 0, journal
    assert_journal_closed(db, "ws")

    status = stack.cli_json("status", "ws")
    [run] = status["runs"]
    assert (run["status"], run["failure_class"]) == ("failed", "summary"), run
    tried = {c["candidate"]: c for c in run["candidates"]}
    assert set(tried) == {"fake-gpt", "fake-claude"}, run["candidates"]
    for candidate in tried.values():
        assert candidate["kind"] == "empty", candidate
        assert "whitespace" in candidate["reason"], candidate
    # A refused answer is not retried: one request per candidate, then the next one.
    assert sorted(r.model or "" for r in fake.requests) == ["fake-claude", "fake-gpt"]


# ------------------------------------------------------------------------------------------
# 5. Redis restarted during a run


def test_redis_restarted_during_a_run_loses_nothing(clean_pg: str, fake: FakeProvider, db: Db,
                                                    tmp_path: Path) -> None:
    """Redis dies (no persistence: every queued message is gone) while a run waits on its
    model and another run is queued. The worker and beat reconnect; the run in flight commits
    to PostgreSQL; the lost message is recovered by the pressure sweep; new tasks run."""
    broker = PrivateRedis(tmp_path)
    broker.start()
    stack = Stack(clean_pg, broker.url, tmp_path / "stack", fake_url=fake.url,
                  # lead 0: an ingest reads as growth, and a lead would have the sweep fire
                  # r-after, which must stay under its trigger for the CLI's run below.
                  summarization={**ONE_CALL, "lead": 0,
                                 "trigger": [{"type": "tokens", "value": 3000}]},
                  worker={"sweep_interval_s": 1.0, "reap_interval_s": 1.0, "lease_s": 10})
    try:
        fake.script(Behaviour(model="fake-gpt", latency_s=6.0, times=1))
        # One slot: while the first run holds it, the second message stays in Redis.
        stack.start_worker("w1", concurrency=1)
        stack.start_beat()
        db.ingest("r-inflight", coding_session(steps=20, big_output_lines=30, seed=1).messages)
        wait_until(lambda: fake.requests, timeout=30, what="the first run's model call")
        db.ingest("r-queued", coding_session(steps=20, big_output_lines=30, seed=2).messages)
        with enqueuer(stack) as enq:
            # As intake does: the signal mark, then the message (the sweep may have done the
            # same already; either way a message for it waits in Redis).
            db.run(lambda s: s.mark_signal("r-queued", ttl_s=120))
            enq.send(RunRequest("r-queued", "pressure"))
        assert broker.queued_runs("r-queued"), "the second run waits in Redis"

        restarted_at = dt.datetime.now(dt.UTC)
        broker.stop()
        time.sleep(1.0)  # the worker notices the lost connection while its run is in flight
        broker.start()
        # (beat's own sweep and reap messages arrive again at once; the run's is gone)
        assert not broker.queued_runs("r-queued"), "the queued message is lost"

        for sid in ("r-inflight", "r-queued"):
            wait_until(lambda: any(r.status == "committed" for r in db.runs(sid)),  # noqa: B023
                       timeout=60, what=f"{sid} to be compacted after the restart")
        [inflight] = [r for r in db.runs("r-inflight") if r.status == "committed"]
        assert inflight.finished_at is not None
        assert inflight.started_at < restarted_at < inflight.finished_at, inflight
        recovered = [r for r in db.runs("r-queued") if r.status == "committed"]
        assert recovered[0].trigger == "sweep", "the sweep found the session the lost task had"
        # A new task after the restart, through the CLI on compaction.urgent: a manual run of
        # a session under its trigger (so the sweep leaves it to the CLI's run).
        db.ingest("r-after", coding_session(steps=12, big_output_lines=20, seed=3).messages)
        result = stack.cli_json("compact", "r-after", "--wait", "--timeout", "60")
        assert result["outcome"] == "committed", result
        for sid in ("r-inflight", "r-queued", "r-after"):
            assert checkpoint_count(db, sid) == (1, 1), sid
            assert_journal_closed(db, sid)
        assert stack.procs["w1"].poll() is None and stack.procs["beat"].poll() is None
        assert stack.log("w1").count("Connected to redis") >= 2, "the worker reconnected"
        assert "3/3 sessions verified" in stack.cli("verify", "--all").stdout
    finally:
        stack.close()
        broker.stop()


def test_worker_survives_a_redis_outage_with_a_run_in_flight(
        clean_pg: str, fake: FakeProvider, db: Db, tmp_path: Path) -> None:
    """Redis stays down for seconds while a run waits on its model, started as the README
    starts a worker (free slots, so the worker has a BRPOP pending when the connection drops).
    On Celery 5.7 the worker closed the broken connection through a transport it had already
    detached and died ("Unrecoverable error ... 'NoneType' object has no attribute
    'hostname'", see worker.broker.Channel). It must reconnect, the run must commit, and
    the worker must take new work."""
    broker = PrivateRedis(tmp_path)
    broker.start()
    stack = Stack(clean_pg, broker.url, tmp_path / "stack", fake_url=fake.url,
                  summarization={**ONE_CALL, "trigger": [{"type": "tokens", "value": 3000}]},
                  worker={"lease_s": 10})
    try:
        fake.script(Behaviour(model="fake-gpt", latency_s=8.0, times=1))
        worker = stack.start("w1", [stack.python, "-m", "celery", "-A", "compactd.worker.app",
                                    "worker", "-Q", "compaction.urgent,compaction.pressure,"
                                    "compaction.bulk", "--concurrency", "4", "-l", "INFO"])
        wait_until(lambda: worker.poll() is not None or "ready" in stack.log("w1"),
                   timeout=60, what="the worker to be ready")
        db.ingest("o-inflight", coding_session(steps=20, big_output_lines=30, seed=4).messages)
        with enqueuer(stack) as enq:
            enq.send(RunRequest("o-inflight", "pressure"))
        wait_until(lambda: fake.requests, timeout=30, what="the run's model call")

        broker.stop()
        wait_until(lambda: "Connection to broker lost" in stack.log("w1")
                   or worker.poll() is not None, timeout=10, what="the worker to see the loss")
        time.sleep(3.0)  # reconnect attempts fail while Redis is down
        assert worker.poll() is None, stack.log("w1")[-4000:]
        broker.start()

        wait_until(lambda: any(r.status == "committed" for r in db.runs("o-inflight")),
                   timeout=60, what="the run in flight to commit")
        wait_until(lambda: stack.log("w1").count("Connected to redis") >= 2
                   or worker.poll() is not None, timeout=30, what="the worker to reconnect")
        assert worker.poll() is None, stack.log("w1")[-4000:]
        assert "Unrecoverable error" not in stack.log("w1")
        # The reconnected worker takes new work.
        db.ingest("o-after", coding_session(steps=12, big_output_lines=20, seed=5).messages)
        result = stack.cli_json("compact", "o-after", "--wait", "--timeout", "60")
        assert result["outcome"] == "committed", result
        for sid in ("o-inflight", "o-after"):
            assert checkpoint_count(db, sid) == (1, 1), sid
            assert_journal_closed(db, sid)
        assert worker.poll() is None
    finally:
        stack.close()
        broker.stop()


# ------------------------------------------------------------------------------------------
# 6. the demo with no servers at all


def test_demo_compacts_without_postgres_or_redis(tmp_path: Path) -> None:
    """No COMPACTD_* URL, a fresh home, and (where ``unshare`` may) a network namespace with
    no connectivity at all: the demo must still compact on the embedded default."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMPACTD_")}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    env["COMPACTD_HOME"] = str(tmp_path)
    argv = [sys.executable, "-m", "compactd.scheduler.cli", "demo", "--json"]
    isolated = _no_network_prefix()
    out = subprocess.run([*isolated, *argv], env=env, capture_output=True, text=True,
                         timeout=180, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads(out.stdout)
    assert report["outcome"]["outcome"] == "committed", report["outcome"]
    assert report["tokens_before"] > report["tokens_after"], report
    assert report["verified"] is True
    assert report["database"].startswith("sqlite"), report["database"]
    assert (tmp_path / "compactd.sqlite3").is_file()
    # It ends by recalling a detail no longer on the surface, found verbatim in the originals.
    recalled = report["recalled"]
    assert recalled["hit"]["exact"] is True and recalled["detail"] in recalled["hit"]["snippet"]


def _no_network_prefix() -> list[str]:
    """``unshare -n`` when this user may create a network namespace, else nothing."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return []
    probe = subprocess.run([unshare, "-n", "true"], capture_output=True)
    return [unshare, "-n"] if probe.returncode == 0 else []
