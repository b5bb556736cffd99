"""A primary that fails over, during a running fleet (issue 29, item 4).

Two PostgreSQL servers of the test's own (tests/support/pg_pair.py): a primary and its streaming
standby, the standby synchronous (synchronous_commit=on, synchronous_standby_names='*').
compactd reaches them through libpq's multi-host URL with target_session_attrs=read-write. A few
simulated runtimes append through the client and pick up checkpoints, a real Celery worker
compacts and beat sweeps; then the primary crashes (an immediate shutdown) and, a moment later,
the standby is promoted. The runtimes' appends fail with a retryable error for the gap and are
retried; the worker's runs that hit it are sent again or end failed, releasing their leases.
After the failover the fleet goes on, on the new primary: every session compacts again, every
session verifies, every append acknowledged to a runtime is in the log with its text, and every
checkpoint a runtime read is still there.

Before the fleet the same primary measures what the synchronous standby costs an append:
appends under synchronous_commit on (waiting for the standby), local and off, in rounds. The
test prints the gap, the retries and those medians (the RUNBOOK quotes them).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from compactd.scheduler.client import CompactdClient, SessionHandle
from compactd.storage.errors import CompactdError, DatabaseUnavailable
from compactd.storage.kinds import NodeKind
from compactd.storage.messages import parse_openai
from compactd.storage.migrate import upgrade_async
from compactd.storage.store import Store
from tests.support.fake_provider import FakeProvider
from tests.support.pg_pair import PostgresPair
from tests.support.stack import Stack
from tests.support.stack_sessions import config_of

pytestmark = pytest.mark.slow

DATABASE = "compactd"
RUNTIMES = 4
POLICY = {"trigger": [{"type": "tokens", "value": 1500}],
          "keep": {"type": "messages", "value": 6}, "model_name": "fake-gpt"}
# The beat's pressure sweep is what finds a session whose signal the failover lost (an append
# that committed, with its signal, on the primary, but whose answer never arrived: its retry
# sees the signal pending): every few seconds here, as the RUNBOOK advises behind a failover.
# The lease and the reaper keep their defaults (60 s, 15 s): a run the crash cut in its commit
# releases its lease once the new primary answers, so its session resumes long before either.
WORKER = {"sweep_interval_s": 2.0}
STEP_PAUSE_S = 0.05
BEFORE_S = 4.0  # the fleet runs this long on the first primary
UNPROMOTED_S = 1.0  # from the crash to the promotion (what a failover manager takes to decide)
AFTER_S = 2.0  # and this long on the new primary, once every session compacted there
# Well under the lease (60 s) and the signal's time to live (60 s): a session whose run the
# crash cut compacts again before either expires.
RESUME_TIMEOUT_S = 30.0
RETRY_PAUSE_S = 0.1
RETRY_BUDGET_S = 30.0  # a runtime that cannot append this long after the crash fails the test
# The run the failover cuts: its summary call is answered after the crash, its checkpoint's
# commit meets no primary, and its end's grace (half of what the task's time limit leaves past
# the deadline: 1 s) runs out before the promotion.
CUT_CALL_S = 3.0
CUT_UNPROMOTED_S = 6.0
CUT_WORKER = {"deadline_s": 20.0, "task_time_limit_s": 22.0}
COMMIT_SETTINGS = ("on", "local", "off")
COST_ROUNDS = 4
COST_APPENDS = 40  # per setting and round


@dataclass
class Runtime:
    """One simulated agent: appends a step (a user and an assistant message) at a time, polls,
    and reads the surface when a compaction moved it; retries what fails retryably."""

    handle: SessionHandle
    acknowledged: dict[int, str] = field(default_factory=dict)  # seq -> text
    checkpoints: set[int] = field(default_factory=set)  # seqs of checkpoints it read
    appends_retried: int = 0
    calls_retried: int = 0  # appends, polls and surface reads
    attempts_failed: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    failed_at: float | None = None  # the first failure of the current outage
    outages: list[tuple[float, float]] = field(default_factory=list)  # (failed, recovered)
    steps: int = 0

    async def retrying(self, call: Any, *, count: int = 0) -> Any:
        failed = False
        while True:
            try:
                result = await call()
            except CompactdError as exc:
                if not exc.retryable:
                    raise
                if self.failed_at is not None and \
                        time.monotonic() - self.failed_at > RETRY_BUDGET_S:
                    raise AssertionError(f"{self.handle.id}: still failing after "
                                         f"{RETRY_BUDGET_S:g} s: {exc}") from exc
                self.errors[str(exc)] += 1
                self.attempts_failed += 1
                if self.failed_at is None:
                    self.failed_at = time.monotonic()
                if not failed:
                    self.calls_retried += 1
                    self.appends_retried += count
                failed = True
                await asyncio.sleep(RETRY_PAUSE_S)
                continue
            if self.failed_at is not None:
                self.outages.append((self.failed_at, time.monotonic()))
                self.failed_at = None
            return result

    async def step(self) -> None:
        n = self.steps
        texts = [f"{self.handle.id} step {n} asks: " + "what next? " * 20,
                 f"{self.handle.id} step {n} answers: " + "the plan goes on. " * 20]
        messages = [{"role": "user", "content": texts[0]},
                    {"role": "assistant", "content": texts[1]}]
        result = await self.retrying(lambda: self.handle.append(messages), count=1)
        for offset, text in enumerate(texts):
            self.acknowledged[result.first_seq + offset] = text
        self.steps += 1
        if await self.retrying(self.handle.poll) is not None:
            surface = await self.retrying(
                lambda: self.handle.client.store.read_surface(self.handle.id))
            self.handle.version = surface.version
            self.checkpoints.update(n.seq for n in surface.nodes if n.kind == NodeKind.CHECKPOINT)

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self.step()
            await asyncio.sleep(STEP_PAUSE_S)


@pytest.mark.timeout(180)
async def test_a_primary_that_fails_over_loses_no_acknowledged_append_or_checkpoint(
        clean_redis: str, tmp_path: Path, fake: FakeProvider) -> None:
    with PostgresPair(synchronous=True) as pair:
        pair.psql(pair.primary_port, f"CREATE DATABASE {DATABASE}")
        url = pair.url(DATABASE)
        await upgrade_async(url)  # through the multi-host URL: it finds the primary
        cost_ms = await _append_cost_by_commit_setting(pair)
        with Stack(url, clean_redis, tmp_path / "stack", fake_url=fake.url,
                   summarization=POLICY, worker=WORKER) as stack:
            stack.start_worker("w1", concurrency=4)
            stack.start_beat()
            report = await _fleet_through_failover(pair, stack)
            verified = stack.cli_json("verify", "--all")
            worker_log = stack.log("w1")
        report["runs_retried"] = worker_log.count("compaction.retry_unavailable")
        report["append_ms_by_synchronous_commit"] = cost_ms
        print("\nfailover:", json.dumps(report, indent=1))
        assert verified == {"ok": True, "sessions": RUNTIMES, "problems": {}}, verified
        assert report["calls_retried"] > 0, "no call of a runtime met the failover"
        # Each run the failover met failed as unavailable (and was retried or ended), none
        # as a data error.
        assert "database error" not in worker_log, worker_log[-3000:]


async def _fleet_through_failover(pair: PostgresPair, stack: Stack) -> dict[str, Any]:
    config = config_of(stack)
    async with CompactdClient(config) as client:
        runtimes = [Runtime(await client.create_session(f"fo-{i}", run_model="fake-gpt"))
                    for i in range(RUNTIMES)]
        stop = asyncio.Event()
        tasks = [asyncio.create_task(r.run(stop)) for r in runtimes]
        try:
            await _wait(tasks, BEFORE_S)
            crashed_at = time.monotonic()
            await asyncio.to_thread(pair.stop_primary)
            await _wait(tasks, UNPROMOTED_S)
            await asyncio.to_thread(pair.promote_standby)
            promoted_at = time.monotonic()
            promoted_db_time = pair.psql(pair.standby_port, "SELECT now()")
            steps_at_promotion = [r.steps for r in runtimes]
            # On until every runtime appended again, then a while longer on the new primary.
            while any(r.steps <= s for r, s in zip(runtimes, steps_at_promotion, strict=True)):
                await _wait(tasks, 0.1)
            resumed_at = time.monotonic()
            # Runs resume too: every session gets a checkpoint committed on the new primary
            # (a run the crash cut must not hold its lease, nor its signal, until they expire).
            compacted_again = await _until_each_session_compacts(pair, tasks, promoted_db_time)
            await _wait(tasks, AFTER_S)
        finally:
            stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)
        for task in tasks:
            task.result()  # a runtime that failed with a non-retryable error fails the test
        lost = await _lost(client.store, runtimes)
        stored_twice = await _stored_twice(client.store, runtimes)
    assert lost == {}, f"acknowledged but lost after the failover: {lost}"
    outages = [o for r in runtimes for o in r.outages]
    return {
        "gap_s": round(resumed_at - crashed_at, 2),
        "promotion_s": round(promoted_at - crashed_at, 2),
        "longest_outage_s": round(max((b - a for a, b in outages), default=0.0), 2),
        "appends": sum(len(r.acknowledged) // 2 for r in runtimes),
        "appends_retried": sum(r.appends_retried for r in runtimes),
        "calls_retried": sum(r.calls_retried for r in runtimes),
        "attempts_failed": sum(r.attempts_failed for r in runtimes),
        "errors": dict(sum((r.errors for r in runtimes), Counter())),
        "checkpoints_read": sum(len(r.checkpoints) for r in runtimes),
        # An append whose connection was lost under it may have committed: its retry then
        # stores it again (these runtimes append without an idempotency key).
        "messages_stored_twice": stored_twice,
        "every_session_compacted_after_promotion_s": round(compacted_again - promoted_at, 2),
    }


@pytest.mark.timed
@pytest.mark.timeout(150)
async def test_a_run_whose_end_the_failover_cut_releases_its_lease_on_the_new_primary(
        clean_redis: str, tmp_path: Path, fake: FakeProvider) -> None:
    """A run asks for its summary, the primary crashes, the answer comes: the checkpoint's
    commit fails and so does writing the run's end, for the whole of its grace. Its lease (the
    default 60 s) would hold the session until it expired and the reaper came; the worker ends
    the run instead once the new primary answers (failed, with its cause), and the session
    compacts again well within 30 s of the promotion."""
    with PostgresPair(synchronous=True) as pair:
        pair.psql(pair.primary_port, f"CREATE DATABASE {DATABASE}")
        url = pair.url(DATABASE)
        await upgrade_async(url)
        fake.script(model="fake-gpt", latency_s=CUT_CALL_S)
        with Stack(url, clean_redis, tmp_path / "stack", fake_url=fake.url,
                   summarization=POLICY, worker=CUT_WORKER) as stack:
            stack.start_worker("w1", concurrency=2)
            async with CompactdClient(config_of(stack)) as client:
                handle = await client.create_session("cut", run_model="fake-gpt")
                for n in range(16):
                    await handle.append([
                        {"role": "user", "content": f"step {n} asks: " + "what next? " * 20},
                        {"role": "assistant", "content": f"step {n}: " + "it goes on. " * 20}])
                for _ in range(300):
                    if fake.requests_for(model="fake-gpt"):
                        break
                    await asyncio.sleep(0.05)
                else:
                    raise AssertionError("no summary was asked for")
            await asyncio.to_thread(pair.stop_primary)
            await asyncio.sleep(CUT_UNPROMOTED_S)
            await asyncio.to_thread(pair.promote_standby)
            promoted_at = time.monotonic()
            promoted_db_time = pair.psql(pair.standby_port, "SELECT now()")
            runs = ("SELECT status || ' ' || coalesce(failure_class, '') || ' ' || "
                    "coalesce(error, '') FROM compaction_runs ORDER BY started_at")
            committed = ("SELECT count(*) FROM compaction_runs WHERE status = 'committed' "
                         f"AND finished_at > '{promoted_db_time}'")
            while pair.psql(pair.standby_port, committed, DATABASE) == "0":
                assert time.monotonic() - promoted_at < RESUME_TIMEOUT_S, (
                    f"no compaction within {RESUME_TIMEOUT_S:g} s of the promotion: "
                    f"{pair.psql(pair.standby_port, runs, DATABASE)}\n"
                    f"{stack.log('w1')[-3000:]}")
                await asyncio.sleep(0.2)
            resumed_s = time.monotonic() - promoted_at
            history = pair.psql(pair.standby_port, runs, DATABASE).splitlines()
            worker_log = stack.log("w1")
        print(f"\ncut run: compacted again {resumed_s:.2f} s after the promotion; runs: {history}")
        cut = history[0]
        assert cut.startswith("failed commit ") and "cannot be reached" in cut, history
        assert "compaction.unended_ended" in worker_log
        assert "reaped an expired lease" not in worker_log


async def _wait(tasks: list[asyncio.Task[None]], seconds: float) -> None:
    """Sleep, but fail at once when a runtime has failed."""
    done, _ = await asyncio.wait(tasks, timeout=seconds, return_when=asyncio.FIRST_EXCEPTION)
    for task in done:
        task.result()


async def _until_each_session_compacts(pair: PostgresPair, tasks: list[asyncio.Task[None]],
                                       since: str) -> float:
    """When every session has a run committed after ``since`` (the new primary's time), while
    the runtimes go on appending."""
    deadline = time.monotonic() + RESUME_TIMEOUT_S
    query = ("SELECT count(DISTINCT session_id) FROM compaction_runs "
             f"WHERE status = 'committed' AND finished_at > '{since}'")
    while True:
        done = int(await asyncio.to_thread(pair.psql, pair.standby_port, query, DATABASE))
        if done == RUNTIMES:
            return time.monotonic()
        assert time.monotonic() < deadline, (
            f"{done} of {RUNTIMES} sessions compacted within {RESUME_TIMEOUT_S:g} s of the "
            "promotion")
        await _wait(tasks, 0.2)


async def _lost(store: Store, runtimes: list[Runtime]) -> dict[str, list[int]]:
    """Per session, the seqs of acknowledged appends and read checkpoints that are not in the
    log as they were acknowledged."""
    lost: dict[str, list[int]] = {}
    for runtime in runtimes:
        events = {e.seq: e for e in await store.read_events(runtime.handle.id)}
        missing = [seq for seq, text in runtime.acknowledged.items()
                   if seq not in events or text not in json.dumps(events[seq].payload)]
        missing += [seq for seq in runtime.checkpoints
                    if seq not in events or events[seq].kind != NodeKind.CHECKPOINT]
        if missing:
            lost[runtime.handle.id] = sorted(missing)
    return lost


async def _stored_twice(store: Store, runtimes: list[Runtime]) -> int:
    """Acknowledged messages that are in their session's log more than once."""
    twice = 0
    for runtime in runtimes:
        payloads = [json.dumps(e.payload) for e in await store.read_events(
            runtime.handle.id, kinds=[NodeKind.MESSAGE])]
        twice += sum(1 for text in runtime.acknowledged.values()
                     if sum(text in payload for payload in payloads) > 1)
    return twice


async def _append_cost_by_commit_setting(pair: PostgresPair) -> dict[str, float]:
    """The median milliseconds of one append (two messages, as a step) under each
    synchronous_commit setting, through a role that has it, interleaved in rounds."""
    stores: dict[str, Store] = {}
    for setting in COMMIT_SETTINGS:
        role = f"commit_{setting}"
        pair.psql(pair.primary_port, f"CREATE ROLE {role} LOGIN SUPERUSER; "
                  f"ALTER ROLE {role} SET synchronous_commit = '{setting}'")
        stores[setting] = Store.from_url(
            f"postgresql://{role}@127.0.0.1:{pair.primary_port}/{DATABASE}", pool_size=2)
    times: dict[str, list[float]] = {s: [] for s in COMMIT_SETTINGS}
    try:
        for setting, store in stores.items():
            await store.create_session(f"cost-{setting}")
        for _ in range(COST_ROUNDS):
            for setting, store in stores.items():
                for i in range(COST_APPENDS):
                    messages = [parse_openai({"role": "user", "content": f"cost {i}"}),
                                parse_openai({"role": "assistant", "content": f"ok {i}"})]
                    started = time.perf_counter()
                    await store.append(f"cost-{setting}", messages)
                    times[setting].append((time.perf_counter() - started) * 1000)
        for setting, store in stores.items():
            # Not the fleet's: `verify --all` counts the fleet's sessions.
            await store.delete_session(f"cost-{setting}")
    finally:
        for store in stores.values():
            await store.close()
    return {s: round(statistics.median(v), 2) for s, v in times.items()}



@pytest.mark.timeout(120)
async def test_a_write_on_a_standby_is_retryable_and_its_connections_are_dropped() -> None:
    """A server that refuses writes (what a demoted primary is, or a standby a URL without
    target_session_attrs reached): the write fails as DatabaseUnavailable, retryable, and the
    pool closes its connections to that server instead of handing them out again, so the next
    connection finds where the primary is now."""
    with PostgresPair(synchronous=False) as pair:
        pair.psql(pair.primary_port, f"CREATE DATABASE {DATABASE}")
        await upgrade_async(pair.single_url(pair.primary_port, DATABASE))
        replayed = "SELECT count(*) FROM pg_tables WHERE tablename = 'alembic_version'"
        while pair.psql(pair.standby_port, replayed, DATABASE) != "1":
            await asyncio.sleep(0.1)
        store = Store.from_url(pair.single_url(pair.standby_port, DATABASE), pool_size=2)
        ours = "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'compactd'"
        try:
            assert await store.all_session_ids() == []  # reads work on a standby
            assert pair.psql(pair.standby_port, ours) == "1"
            with pytest.raises(DatabaseUnavailable) as refused:
                await store.create_session("on-a-standby")
            assert refused.value.retryable and "25006" in str(refused.value)
            for _ in range(100):  # the refused connection is closed, not put back
                if pair.psql(pair.standby_port, ours) == "0":
                    break
                await asyncio.sleep(0.1)
            else:
                raise AssertionError("the pool kept its connection to the read-only server")
        finally:
            await store.close()
