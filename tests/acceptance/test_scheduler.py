"""The scheduler with real processes: Celery workers and beat as subprocesses, the ``compactd`` CLI,
real PostgreSQL and Redis, the fake provider over HTTP through the real SDKs. The runtime side is
the real client library in this process.

Each test shortens what it waits on through config keys (sweep interval, lease length, loop-guard
limits) and keeps its sessions small; timing bounds are generous because the machine is shared.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import redis

from compactd.scheduler.client import Client, CompactdClient, SessionHandle, SyncSession
from compactd.scheduler.samples import coding_session, iter_steps
from compactd.storage.kinds import ItemState
from compactd.storage.messages import parse_openai
from compactd.storage.records import Claim
from compactd.storage.store import Store
from compactd.worker.keys import QUEUES
from tests.support.stack import Stack, openai_models, wait_until
from tests.support.stack_sessions import POLICY, TRIGGER, config_of, many_sessions
from tests.support.tables import row_counts

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.redis]

T = TypeVar("T")


async def until(predicate: Callable[[], Awaitable[T]], *, timeout: float, what: str,
                interval: float = 0.05) -> T:
    deadline = time.monotonic() + timeout
    while True:
        value = await predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        await asyncio.sleep(interval)


async def settled(store: Store, session_id: str, *, timeout: float = 60.0) -> None:
    """Wait until no run holds the session and no signal's task is pending."""
    async def idle() -> bool:
        info = await store.get_session(session_id)
        return info.lease_run_id is None and info.signal_at is None
    await until(idle, timeout=timeout, what=f"{session_id} to settle")


def checkpoints(messages: list[dict[str, Any]]) -> int:
    return sum(1 for m in messages if (m.get("meta") or {}).get("checkpoint")
               and m["role"] != "system")


def queued(url: str) -> int:
    r = redis.Redis.from_url(url)
    try:
        return sum(int(r.llen(q)) for q in QUEUES)
    finally:
        r.close()


# ------------------------------------------------------------------------------------------
# 1. the agent loop never waits for a compaction


class AgentLoop:
    """A runtime's loop: append the step, poll, re-read the surface only when a checkpoint
    committed; its local view of the conversation is what it would send to the model."""

    def __init__(self, session: SessionHandle | SyncSession) -> None:
        self.session = session
        self.view: list[tuple[str, Any]] = []
        self.step_s: list[float] = []
        self.pickups = 0
        self.windows: list[tuple[dt.datetime, dt.datetime]] = []

    def absorb(self, step: list[dict[str, Any]], moved: int | None,
               surface: list[dict[str, Any]] | None) -> None:
        if moved is None:
            self.view.extend((m["role"], m.get("content")) for m in step)
        else:
            assert surface is not None and checkpoints(surface) >= 1, \
                "the version moved without a checkpoint"
            self.view = [(m["role"], m.get("content")) for m in surface]
            self.pickups += 1

    async def step(self, messages: list[dict[str, Any]]) -> None:
        assert isinstance(self.session, SessionHandle)
        began, t0 = dt.datetime.now(dt.UTC), time.perf_counter()
        await self.session.append(messages)
        moved = await self.session.poll()
        surface = await self.session.surface() if moved is not None else None
        self.step_s.append(time.perf_counter() - t0)
        self.windows.append((began, dt.datetime.now(dt.UTC)))
        self.absorb(messages, moved, surface)

    async def catch_up(self) -> None:
        """What the next step's poll would pick up (the last append may have fired a run)."""
        assert isinstance(self.session, SessionHandle)
        moved = await self.session.poll()
        self.absorb([], moved, await self.session.surface() if moved is not None else None)

    def step_sync(self, messages: list[dict[str, Any]]) -> None:
        assert isinstance(self.session, SyncSession)
        t0 = time.perf_counter()
        self.session.append(messages)
        moved = self.session.poll()
        surface = self.session.surface() if moved is not None else None
        self.step_s.append(time.perf_counter() - t0)
        self.absorb(messages, moved, surface)


@pytest.mark.timed
@pytest.mark.timeout(240)
async def test_agent_loop_picks_up_checkpoints_and_never_waits(make_stack, fake) -> None:  # type: ignore[no-untyped-def]
    fake.latency_s = 2.0  # every summary takes two seconds
    stack = make_stack(summarization=POLICY)
    stack.start_worker("w1", concurrency=4)
    config = config_of(stack)
    async with CompactdClient(config) as client:
        session = await client.create_session("agent", run_model="fake-gpt")
        loop = AgentLoop(session)
        for step in iter_steps(coding_session(steps=30, big_output_lines=40)):
            await loop.step(step)
            await asyncio.sleep(0.2)  # the model thinking
        picked_up_in_loop = loop.pickups
        await settled(client.store, "agent")
        # The agent's next step picks up whatever committed after its last one.
        await loop.step([{"role": "user", "content": "Thanks, that is all."}])
        await settled(client.store, "agent")
        await loop.catch_up()
        final = await session.surface()
        info = await client.store.get_session("agent")
        runs = await client.store.session_runs("agent")

    committed = [r for r in runs if r.status == "committed"]
    slowest = max(loop.step_s)
    during = sum(1 for began, ended in loop.windows
                 if any(r.finished_at and r.started_at <= began and ended <= r.finished_at
                        for r in committed))
    slow = [(i, round(t * 1000)) for i, t in enumerate(loop.step_s) if t > 0.05]
    print(f"\nagent loop: {len(loop.step_s)} steps, slowest {slowest * 1000:.0f} ms, "
          f"median {sorted(loop.step_s)[len(loop.step_s) // 2] * 1000:.1f} ms; "
          f"{len(committed)} compactions, {during} steps inside one, {loop.pickups} pickups; "
          f"steps over 50 ms: {slow}")
    assert len(committed) >= 2, [(r.status, r.failure_class, r.error) for r in runs]
    assert during >= 3, "no step ran while a compaction was in flight"
    assert slowest < 0.5, f"a step took {slowest:.3f} s: it waited for something"
    assert picked_up_in_loop >= 1, "no checkpoint was picked up while the agent worked"
    # The runtime's incremental view is exactly the checkpointed surface.
    assert loop.view == [(m["role"], m.get("content")) for m in final]
    assert checkpoints(final) == 1
    assert info.surface_tokens + info.envelope_tokens < TRIGGER
    verified = stack.cli("verify", "agent")
    assert "1/1 sessions verified" in verified.stdout

    # The synchronous client drives the same loop.
    with Client(config) as sync_client:
        sync_session = sync_client.create_session("agent-sync", run_model="fake-gpt")
        sync_loop = AgentLoop(sync_session)
        for step in list(iter_steps(coding_session(steps=14, big_output_lines=40,
                                                   call_prefix="sync")))[:12]:
            sync_loop.step_sync(step)
        sync_store = Store.from_url(config.database_url, pool_size=1)
        try:
            await settled(sync_store, "agent-sync")
            sync_loop.step_sync([{"role": "user", "content": "Done."}])
            await settled(sync_store, "agent-sync")
        finally:
            await sync_store.close()
        moved = sync_session.poll()
        sync_loop.absorb([], moved, sync_session.surface() if moved is not None else None)
        final_sync = sync_session.surface()
    assert max(sync_loop.step_s) < 0.5
    assert sync_loop.pickups >= 1 and checkpoints(final_sync) == 1
    assert sync_loop.view == [(m["role"], m.get("content")) for m in final_sync]
    assert "1/1 sessions verified" in stack.cli("verify", "agent-sync").stdout


# ------------------------------------------------------------------------------------------
# 2. overflow recovery


@pytest.mark.timed
@pytest.mark.timeout(120)
async def test_report_overflow_gets_a_smaller_surface_or_a_prompt_no(make_stack, fake) -> None:  # type: ignore[no-untyped-def]
    fake.latency_s = 0.5
    # A trigger no session here reaches: only the overflow report compacts.
    stack = make_stack(summarization={**POLICY, "trigger": [{"type": "tokens",
                                                             "value": 100_000}]})
    stack.start_worker("w1", concurrency=2)
    async with CompactdClient(config_of(stack)) as client:
        big = await client.create_session("big", run_model="fake-gpt")
        for step in iter_steps(coding_session(steps=12, big_output_lines=40)):
            await big.append(step)
        before = await client.store.get_session("big")
        t0 = time.perf_counter()
        result = await big.report_overflow(timeout_s=30)
        took = time.perf_counter() - t0
        assert result.compacted, result.reason
        assert result.messages is not None and checkpoints(result.messages) == 1
        after = await client.store.get_session("big")
        assert after.surface_tokens < before.surface_tokens
        assert result.version == after.surface_version > before.surface_version
        assert len(result.messages) < before.surface_messages
        assert result.run is not None and result.run["outcome"] == "committed"
        assert took < 30

        # One assistant turn and its results: nothing a compaction could cut.
        one = await client.create_session("one-group", run_model="fake-gpt")
        await one.append([
            {"role": "assistant", "content": "Reading both logs.", "tool_calls": [
                {"id": f"c{i}", "type": "function",
                 "function": {"name": "bash", "arguments": json.dumps({"n": i})}}
                for i in range(2)]},
            *({"role": "tool", "tool_call_id": f"c{i}", "name": "bash",
               "content": "log line\n" * 300} for i in range(2))])
        t0 = time.perf_counter()
        refused = await one.report_overflow(timeout_s=30)
        took_refusal = time.perf_counter() - t0
        runs = await client.store.session_runs("one-group")
    print(f"\noverflow: compacted in {took:.2f} s; nothing-to-compact answer in "
          f"{took_refusal * 1000:.0f} ms")
    assert not refused.compacted and refused.reason.startswith("nothing to compact")
    assert took_refusal < 1.0
    assert runs == [], "the refusal enqueued a run"


# ------------------------------------------------------------------------------------------
# 3. signals: a burst makes one run; a flushed Redis loses nothing


@pytest.mark.timed
@pytest.mark.timeout(120)
async def test_a_thousand_signals_make_one_compaction_run(make_stack, fake) -> None:  # type: ignore[no-untyped-def]
    fake.latency_s = 2.0  # the run is in flight for the whole burst
    stack = make_stack(summarization=POLICY)
    stack.ingest("hot", coding_session(steps=20, big_output_lines=40).messages)
    stack.start_worker("w1", concurrency=4)
    async with CompactdClient(config_of(stack)) as client:
        session = await client.get_session("hot")

        async def sender(n: int) -> list[bool]:
            return [(await session.signal()).enqueued for _ in range(n)]

        # The broker is reached once first: the transport's import and the first connection
        # take a second at load, and the bound below is on the burst.
        await asyncio.to_thread(client.enqueuer.queue_depths)
        t0 = time.perf_counter()
        sent = await asyncio.gather(*(sender(250) for _ in range(4)))
        burst_s = time.perf_counter() - t0
        burst_ended = dt.datetime.now(dt.UTC)
        enqueued = sum(flag for flags in sent for flag in flags)
        await settled(client.store, "hot")
        # Signals after the run find the session relieved.
        late = await session.signal()
        runs = await client.store.session_runs("hot")
    print(f"\n1000 signals in {burst_s:.2f} s -> {enqueued} enqueued, {len(runs)} runs")
    assert enqueued == 1
    assert [(r.trigger, r.status) for r in runs] == [("pressure", "committed")]
    # Every signal came while that one run was queued or running (the de-duplication window);
    # about a second on a quiet machine, more when the machine is shared.
    assert runs[0].finished_at is not None and burst_ended < runs[0].finished_at
    assert burst_s < 4.0
    assert not late.enqueued and late.reason.startswith("not compacting")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def make_stack(make_stack, fake):  # type: ignore[no-untyped-def]
    """conftest's, with only the openai fake models: these tests call fake-gpt and fake-mini,
    and each worker start imports the SDK of every configured model."""
    return lambda **kwargs: make_stack(**{"models": openai_models(fake.url), **kwargs})


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[str]:
    """A Redis of this test's own, so it can be flushed without touching anyone else's."""
    port = _free_port()
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1",
                             "--save", "", "--appendonly", "no", "--dir", str(tmp_path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        client = redis.Redis.from_url(url)
        wait_until(lambda: _pings(client), timeout=10, what="the private redis-server")
        client.close()
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False


@pytest.mark.timed
@pytest.mark.timeout(120)
async def test_a_flushed_redis_loses_no_compaction(clean_pg, private_redis, tmp_path, fake) -> None:  # type: ignore[no-untyped-def]
    sweep_s = 3.0
    stack = Stack(clean_pg, private_redis, tmp_path / "stack", fake_url=fake.url,
                  models=openai_models(fake.url), summarization=POLICY,
                  worker={"sweep_interval_s": sweep_s, "reap_interval_s": sweep_s})
    try:
        stack.ingest("lost", coding_session(steps=20, big_output_lines=40).messages)
        async with CompactdClient(config_of(stack)) as client:
            result = await (await client.get_session("lost")).signal()
            assert result.enqueued
            assert queued(private_redis) == 1
            r = redis.Redis.from_url(private_redis)
            r.flushall()  # between the signal and the pickup: the task is gone
            r.close()
            assert queued(private_redis) == 0
            stack.start_worker("w1", concurrency=2)
            stack.start_beat()
            wait_until(lambda: "beat: Starting" in stack.log("beat"), timeout=30,
                       what="beat to start")
            started = time.monotonic()

            async def compacted() -> bool:
                runs = await client.store.session_runs("lost")
                return any(r.status == "committed" for r in runs)

            await until(compacted, timeout=4 * sweep_s + 30, what="the sweep to compact it")
            took = time.monotonic() - started
            runs = await client.store.session_runs("lost")
    finally:
        stack.close()
    print(f"\nflushed Redis: compacted {took:.1f} s after beat started "
          f"(sweep interval {sweep_s:g} s)")
    assert [(r.trigger, r.status) for r in runs] == [("sweep", "committed")]
    # Within two sweep intervals, plus the run itself.
    assert took <= 2 * sweep_s + 1.0


@pytest.mark.timed
@pytest.mark.timeout(120)
async def test_the_reaper_requeues_a_session_whose_worker_died(make_stack) -> None:  # type: ignore[no-untyped-def]
    reap_s, lease_s = 1.0, 2.0
    # A sweep interval no test waits for: only the reaper can bring this session back.
    stack = make_stack(summarization=POLICY, worker={
        "reap_interval_s": reap_s, "lease_s": lease_s, "sweep_interval_s": 600})
    stack.ingest("orphan", coding_session(steps=20, big_output_lines=40).messages)
    async with CompactdClient(config_of(stack)) as client:
        store = client.store
        # A worker took the session for a signal's run and died: its signal mark, its lease,
        # its run row and an open compaction/start are all that is left of it.
        assert await store.mark_signal("orphan", ttl_s=120)
        dead = await store.claim("orphan", owner="dead-worker", trigger="pressure",
                                 lease_s=lease_s)
        assert isinstance(dead, Claim)
        session = await client.get_session("orphan")
        assert not (await session.signal()).enqueued  # the dead run's mark blocks signals
        stack.start_worker("w1", concurrency=2)
        stack.start_beat()
        wait_until(lambda: "beat: Starting" in stack.log("beat"), timeout=30,
                   what="beat to start")
        started = time.monotonic()

        async def recovered() -> list[Any]:
            return [r for r in await store.session_runs("orphan")
                    if (r.trigger, r.status) == ("reap", "committed")]

        await until(recovered, timeout=60, what="the reaper to re-enqueue the session")
        took = time.monotonic() - started
        abandoned = await store.get_run(dead.run_id)
    print(f"\nreaper: the dead worker's session compacted {took:.1f} s after beat started "
          f"(reap interval {reap_s:g} s)")
    assert abandoned is not None and (abandoned.status, abandoned.failure_class) == (
        "failed", "abandoned")
    # The lease had long expired: the first reap tick takes it, then one compaction.
    assert took <= 2 * reap_s + 3.0
    assert "1/1 sessions verified" in stack.cli("verify", "orphan").stdout


# ------------------------------------------------------------------------------------------
# 4. bulk recompaction


@pytest.mark.timeout(120)
async def test_recompact_dry_run_counts_and_enqueues_nothing(make_stack) -> None:  # type: ignore[no-untyped-def]
    stack = make_stack(summarization=POLICY)
    store = Store.from_url(stack.database_url)
    try:
        await many_sessions(store, 1000, tenants=("acme", "globex"), steps=0)
        out = stack.cli("recompact", "--dry-run", "--force")
        lines = out.stdout.splitlines()
        assert lines[0] == "1000 sessions match; nothing enqueued (dry run)"
        # The sessions it matched, a bounded list in text; all of them in JSON.
        assert lines[1:21] == [f"  bulk-{i:04d}" for i in range(20)]
        assert lines[21:] == ["  ... and 980 more (--json lists them all)"]
        body = stack.cli_json("recompact", "--dry-run", "--tenant", "acme")
        assert (body["dry_run"], body["matched"]) == (True, 500)
        assert body["filter"] == {"tenant": "acme"}
        assert body["sessions"] == [f"bulk-{i:04d}" for i in range(0, 1000, 2)]
        assert queued(stack.redis_url) == 0
        assert await store.list_bulk_jobs() == []
        assert (await row_counts(store))["compaction_runs"] == 0
        assert stack.cli_json("status")["bulk_jobs"] == []
    finally:
        await store.close()


def _max_in_window(times: list[float], window_s: float = 1.0) -> int:
    """The most requests in any window of ``window_s`` (half-open, starting at a request)."""
    times = sorted(times)
    best, j = 0, 0
    for i, start in enumerate(times):
        j = max(j, i)
        while j < len(times) and times[j] < start + window_s:
            j += 1
        best = max(best, j - i)
    return best


@pytest.mark.timed
@pytest.mark.timeout(240)
async def test_recompact_at_a_rate_killed_and_resumed_compacts_each_session_once(  # type: ignore[no-untyped-def]
        make_stack, fake) -> None:
    rate = 50
    # Sessions large enough that each summary takes several model calls (budget-sized chunks):
    # two busy workers then ask for more than the rate even on a shared machine.
    n = 40
    fake.latency_s = 0.05
    # Short leases: a bulk item that finds its session leased is retried a third of one apart.
    # share_cache off: a summary by the run model would read the whole range in one call.
    stack = make_stack(summarization={**POLICY, "share_cache": False}, worker={"lease_s": 3.0})
    store = Store.from_url(stack.database_url)
    try:
        ids = await many_sessions(store, n, steps=20)
        # A live session outside the job (its own summary model, so its calls are told apart).
        await store.create_session("live", tenant="live", run_model="fake-gpt",
                                   policy={"model_name": "fake-mini"})
        await store.append("live", [parse_openai(m) for m in coding_session(
            steps=20, big_output_lines=30, call_prefix="live").messages])

        # No worker yet: the first half of the fan-out piles up on compaction.bulk.
        first = stack.start("recompact-1", [sys.executable, "-m", "compactd.scheduler.cli",
                                            "recompact", "--tenant", "default", "--force", "--rate",
                                            f"{rate}/s", "--chunk", "10", "--json"])

        async def half_enqueued() -> str | None:
            jobs = await store.list_bulk_jobs()
            return jobs[0].id if jobs and jobs[0].enqueued >= n // 2 else None

        job_id = await until(half_enqueued, timeout=60, what="half the items enqueued")
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(timeout=10)
        killed = await store.get_bulk_job(job_id)
        assert killed is not None and 0 < killed.pending < n and killed.done == 0

        stack.start_worker("w1", concurrency=8)
        stack.start_worker("w2", concurrency=8)
        # A worker died holding a session's lease: its bulk item (the first the resume sends)
        # finds it busy, and is retried until the lease expires and the next claim closes it.
        stuck_id = (await store.bulk_items(job_id, states=[ItemState.PENDING], limit=1))[0]
        stuck = await store.claim(stuck_id, owner="dead-worker", trigger="pressure", lease_s=5.0)
        assert isinstance(stuck, Claim)
        resume = subprocess.Popen(
            [sys.executable, "-m", "compactd.scheduler.cli", "recompact", "--resume", job_id,
             "--json"],
            env=stack.env, cwd=stack.home, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True)
        try:
            # Urgent work is not starved by the bulk backlog: a manual compaction someone waits
            # for runs on compaction.urgent while the job is under way.
            async def under_way() -> bool:
                running = await store.get_bulk_job(job_id)
                return running is not None and running.done > 0
            await until(under_way, timeout=60, what="the resumed job to be under way")
            async with CompactdClient(config_of(stack)) as client:
                t0 = time.monotonic()
                urgent = await (await client.get_session("live")).compact(timeout_s=60)
                urgent_s = time.monotonic() - t0
            out, err = await asyncio.to_thread(resume.communicate, timeout=180)
        finally:
            if resume.poll() is None:
                resume.kill()
        assert resume.returncode == 0, err
        resumed = json.loads(out)
        assert resumed["job"]["id"] == job_id
        assert (resumed["job"]["done"], resumed["job"]["failed"]) == (n, 0)
        progress = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
        assert progress and progress[-1]["done"] == n  # JSON progress with --json
        assert urgent["outcome"] == "committed" and urgent["model"] == "fake-mini"
        assert urgent_s < 10

        listed = stack.cli_json("status")["bulk_jobs"]
        assert [(j["id"], j["matched"], j["done"], j["failed"], j["pending"], j["state"])
                for j in listed] == [(job_id, n, n, 0, 0, "done")]
        calls, waited_s, last_bulk = 0, 0.0, dt.datetime.min.replace(tzinfo=dt.UTC)
        for sid in ids:
            runs = [r for r in await store.session_runs(sid) if r.bulk_job_id == job_id]
            assert [r.status for r in runs if r.status != "failed"] == ["committed"], sid
            assert {r.failure_class for r in runs if r.status == "failed"} <= {"busy"}, sid
            committed = [r for r in runs if r.status == "committed"]
            calls += sum(len(r.candidates or ()) for r in committed)
            waited_s += sum((r.stages or {})["rate_wait_s"] for r in committed)
            last_bulk = max([last_bulk, *(r.finished_at for r in committed if r.finished_at)])
        # The urgent run did not wait for the bulk backlog to drain.
        assert dt.datetime.fromisoformat(urgent["finished_at"]) < last_bulk
        surfaces = [await store.read_surface(sid) for sid in ids]
        assert all(sum(1 for node in s.nodes if node.kind == "checkpoint") == 1
                   for s in surfaces)
        stuck_runs = await store.session_runs(stuck_id)
        assert {(r.status, r.failure_class) for r in stuck_runs} >= {
            ("failed", "abandoned"), ("failed", "busy"), ("committed", None)}
    finally:
        await store.close()
    assert f"{n + 1}/{n + 1} sessions verified" in stack.cli("verify", "--all").stdout

    times = [r.received_at for r in fake.requests_for(model="fake-gpt")]
    assert len(times) == calls, "a model call that no committed run accounts for"
    peak = _max_in_window(times)
    span = max(times) - min(times)
    mean = (len(times) - 1) / span
    print(f"\nrecompact at {rate}/s: {n} sessions, {calls} model calls over {span:.2f} s "
          f"(mean {mean:.1f}/s), peak {peak} in any 1 s window; calls waited {waited_s:.1f} s "
          f"in all on the meter; an urgent compaction during the job took {urgent_s:.1f} s")
    # The criterion: the meter reserves slots 1/rate apart, so at most `rate` calls start in any
    # half-open one-second window; the fake's receive times add delivery jitter, allowed for
    # with 10% (five calls, 100 ms). Over the whole run the mean rate is at most the rate.
    assert peak <= rate + rate // 10
    assert mean <= rate * 1.02
    # The meter really held calls back (two workers took a backlog 16 at a time); were it not
    # applied, no call would have waited.
    assert waited_s > 1.0, "no call waited on the meter: the test proves nothing"


# ------------------------------------------------------------------------------------------
# 5. the loop guard


@pytest.mark.timeout(120)
async def test_a_session_without_relief_is_flagged_and_cooled_down(make_stack, fake) -> None:  # type: ignore[no-untyped-def]
    fake.latency_s = 0.3
    # clear_at_least 0: each run's summary frees less than a cache break's worth and could not
    # relieve the session, which by default ends it with nothing to do and waits for growth
    # (test_low_trigger.py); the loop guard is the net for a policy that does commit them.
    stack = make_stack(summarization={**POLICY, "clear_at_least": 0}, worker={
        "sweep_interval_s": 1.0,
        "loop_guard": {"max_compactions": 2, "window_s": 120, "margin": 0.1,
                       "cooldown_s": 120}})
    stack.start_worker("w1", concurrency=2)
    stack.start_beat()
    # The runtime's system prompt alone is over the trigger: no compaction can relieve it.
    envelope = {"system": "You are a careful coding agent. " * 400}
    async with CompactdClient(config_of(stack)) as client:
        session = await client.create_session("stuck", run_model="fake-gpt", envelope=envelope)
        assert session.info.envelope_tokens > TRIGGER
        steps = iter_steps(coding_session(steps=60, big_output_lines=40))
        # Some history first, so the first run already has something to compact.
        await session.append([m for _ in range(8) for m in next(steps)])

        async def flagged() -> bool:
            await session.append(next(steps))
            await asyncio.sleep(0.2)
            return (await client.store.get_session("stuck")).flagged_reason is not None

        await until(flagged, timeout=60, what="the loop guard to flag the session")
        runs_at_flag = len(await client.store.session_runs("stuck"))
        # The agent keeps going for a while (and the sweep keeps ticking): no more compactions.
        for _ in range(6):
            result = await session.append(next(steps))
            assert result.fired and not result.signalled
            await asyncio.sleep(0.4)
        runs = await client.store.session_runs("stuck")
    body = stack.cli_json("status")
    assert [f["session"] for f in body["flagged"]] == ["stuck"]
    flag = body["flagged"][0]
    assert "without pressure falling" in flag["reason"] and flag["cooldown_until"]
    assert stack.cli_json("status", "stuck")["flagged"]["reason"] == flag["reason"]
    # More than max_compactions (2) commits without relief, then nothing: the first steps had
    # nothing compactable yet (those runs are nothing_to_do), and no run came after the flag.
    assert len(runs) == runs_at_flag
    assert sum(r.status == "committed" for r in runs) == 3
    flagged_at = dt.datetime.fromisoformat(flag["flagged_at"])
    assert all(r.started_at <= flagged_at for r in runs)
    assert "sweep" not in {r.trigger for r in runs}


# ------------------------------------------------------------------------------------------
# bad input to signal and recompact


def test_signal_and_recompact_errors_are_bad_input(make_stack) -> None:  # type: ignore[no-untyped-def]
    stack = make_stack(summarization=POLICY)
    stack.ingest("s1", coding_session(steps=20, big_output_lines=40).messages)
    for args, message in [
        (["signal", "ghost"], "session 'ghost' does not exist"),
        (["signal", "s1", "--reason", "panic"], "--reason: invalid choice: 'panic'"),
        (["signal", "x" * 300], "field 'session'"),
        (["recompact", "--rate", "fast/s"], "field 'rate': not a rate"),
        (["recompact", "--idle-for", "soon", "--dry-run"], "not a duration"),
        (["recompact", "--resume", "nosuchjob"], "no bulk job 'nosuchjob'"),
    ]:
        out = stack.cli(*args, check=False)
        assert out.returncode == 2, (args, out.stdout, out.stderr)
        assert message in out.stderr and out.stdout == ""
    body = stack.cli_json("signal", "s1")
    assert body["enqueued"] is True and body["task_id"]
    assert stack.cli_json("signal", "s1")["reason"] == "a compaction is already queued or running"
    assert queued(stack.redis_url) == 1
