"""The scheduler's decisions against real databases (PostgreSQL and the embedded SQLite) and, where
it matters, real Redis: signal intake and de-duplication, the runtime client's append/poll/usage,
sweeps, the lease reaper, the loop guard, follow-up signals, bulk item states and the shared rate
meter. Enqueues are recorded (``RecordingEnqueuer``) unless the test is about the queue itself."""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
import sqlalchemy as sa

from compactd.scheduler import client as client_module
from compactd.scheduler.bulk import BulkFilter, fan_out, matching_sessions
from compactd.scheduler.client import CompactdClient
from compactd.scheduler.intake import SignalPayload, accept_signal
from compactd.scheduler.status import status
from compactd.storage.errors import InvalidMessage, SessionNotFound
from compactd.storage.kinds import ItemState, JournalKind
from compactd.storage.records import Claim, utcnow
from compactd.storage.store import Store
from compactd.worker.app import client_app
from compactd.worker.enqueue import Enqueuer, RunRequest, follow_up
from compactd.worker.keys import QUEUE_PRESSURE, TASK_RUN
from compactd.worker.limits import JITTER_MARGIN, RedisLimiter
from compactd.worker.orchestration import compact
from compactd.worker.settings import Config
from compactd.worker.sweeps import reap_leases, sweep_pressure
from tests.support.enqueuer import RecordingEnqueuer
from tests.support.scheduler_sessions import (
    TRIGGER,
    deps_for,
    make_config,
    over,
    parsed,
    text,
    user,
)


@pytest.fixture
def config(db_url: str) -> Config:
    return make_config(db_url)


@pytest.fixture
def enqueuer() -> RecordingEnqueuer:
    return RecordingEnqueuer()


@pytest.fixture
async def client(config: Config, store: Store, enqueuer: RecordingEnqueuer
                 ) -> AsyncIterator[CompactdClient]:
    async with CompactdClient(config, store=store, enqueuer=enqueuer) as c:
        yield c


def tool_step(tokens: int, tag: str) -> list[dict[str, Any]]:
    """An assistant tool call and its result of about ``tokens`` tokens: what summaries shrink
    well (the local summarizer keeps a result's paths and errors, not its text)."""
    call = f"call_{tag}"
    return [{"role": "assistant", "content": None, "tool_calls": [
                {"id": call, "type": "function",
                 "function": {"name": "bash", "arguments": '{"command": "ls"}'}}]},
            {"role": "tool", "tool_call_id": call, "name": "bash", "content": text(tokens, tag)}]


# ------------------------------------------------------------------------------------------
# signal intake


async def test_signal_for_an_unknown_session_is_refused(config: Config, store: Store,
                                                         enqueuer: RecordingEnqueuer) -> None:
    with pytest.raises(SessionNotFound, match="'ghost' does not exist"):
        await accept_signal(store, config, enqueuer, SignalPayload(session="ghost"))
    assert enqueuer.sent == []


async def test_client_signal_with_a_bad_reason_names_the_field(client: CompactdClient) -> None:
    handle = await client.create_session("s1")
    with pytest.raises(InvalidMessage) as err:
        await handle.signal("panic")
    assert err.value.field == "reason"


async def test_signal_under_the_trigger_enqueues_nothing(client: CompactdClient,
                                                         enqueuer: RecordingEnqueuer) -> None:
    handle = await client.create_session("s1", run_model="gpt-4o")
    await handle.append([user(50)])
    result = await handle.signal()
    assert not result.enqueued and result.reason.startswith("not compacting")
    assert enqueuer.sent == []


async def test_a_burst_of_signals_enqueues_one_task(client: CompactdClient,
                                                    enqueuer: RecordingEnqueuer) -> None:
    handle = await over(client)
    results = await asyncio.gather(*(handle.signal() for _ in range(200)))
    enqueued = [r for r in results if r.enqueued]
    assert len(enqueued) == 1 and len(enqueuer.sent) == 1
    assert enqueuer.sent[0].trigger == "pressure" and enqueuer.sent[0].session_id == "s1"
    assert {r.reason for r in results if not r.enqueued} == {
        "a compaction is already queued or running"}


async def test_the_next_signal_enqueues_again_once_the_run_cleared_the_mark(
        client: CompactdClient, store: Store, enqueuer: RecordingEnqueuer) -> None:
    handle = await over(client)
    assert (await handle.signal()).enqueued
    assert not (await handle.signal()).enqueued
    await store.clear_signal("s1")  # what the worker does when the signal's run ends
    assert (await handle.signal()).enqueued
    assert len(enqueuer.sent) == 2


async def test_a_lost_signal_mark_expires_after_its_ttl(db_url: str, store: Store) -> None:
    config = make_config(db_url, worker={"signal_ttl_s": 0.2})
    enqueuer = RecordingEnqueuer()
    async with CompactdClient(config, store=store, enqueuer=enqueuer) as client:
        handle = await over(client)
        assert (await handle.signal()).enqueued
        assert not (await handle.signal()).enqueued
        await asyncio.sleep(0.3)
        assert (await handle.signal()).enqueued


async def test_appends_and_usage_reports_take_over_a_lost_mark_after_its_ttl(
        db_url: str, store: Store) -> None:
    """A runtime that only appends and reports usage (it never signals): the task its append
    queued is lost, and its next appends fire no run while the mark lives; once the mark is
    older than ``worker.signal_ttl_s`` the next append, or usage report, queues one again."""
    config = make_config(db_url, worker={"signal_ttl_s": 0.2})
    enqueuer = RecordingEnqueuer()
    async with CompactdClient(config, store=store, enqueuer=enqueuer) as client:
        handle = await over(client)
        assert (await handle.append([user(5)])).signalled
        assert not (await handle.append([user(5)])).signalled
        await asyncio.sleep(0.3)
        assert (await handle.append([user(5)])).signalled
        await asyncio.sleep(0.3)
        await handle.report_usage(TRIGGER + 100)
        await client.drain()
    assert [r.trigger for r in enqueuer.sent] == ["pressure"] * 3, enqueuer.sent


async def test_a_cooling_session_is_not_signalled(client: CompactdClient, store: Store,
                                                  enqueuer: RecordingEnqueuer,
                                                  config: Config) -> None:
    handle = await over(client)
    await store.flag_session("s1", reason="test", cooldown_until=utcnow() + dt.timedelta(
        minutes=5))
    result = await handle.signal()
    assert not result.enqueued and "cooling down" in result.reason
    step = await handle.append([user(20)])
    assert step.fired and not step.signalled
    assert (await sweep_pressure(store, config, enqueuer)).enqueued == ()
    await client.drain()
    assert enqueuer.sent == []


# ------------------------------------------------------------------------------------------
# the runtime client


async def test_append_returns_totals_and_signals_once_per_burst(
        client: CompactdClient, enqueuer: RecordingEnqueuer) -> None:
    handle = await client.create_session("s1", run_model="gpt-4o")
    first = await handle.append([user(100), {"role": "assistant", "content": "ok"}])
    assert (first.first_seq, first.last_seq, first.messages) == (1, 2, 2)
    assert first.tokens == (await client.store.read_surface("s1")).tokens
    assert not first.fired and not first.signalled
    steps = [await handle.append([user(150)]) for _ in range(4)]
    assert [s.fired for s in steps] == [False, True, True, True]
    assert [s.signalled for s in steps] == [False, True, False, False]
    assert steps[-1].tokens > steps[0].tokens and steps[-1].last_seq == 6
    await client.drain()  # the signal is sent in the background
    assert len(enqueuer.sent) == 1
    assert json.loads(json.dumps(steps[1].to_json()))["signalled"] is True


class RefusingEnqueuer(RecordingEnqueuer):
    """A broker that refuses every send, once the test lets the send end."""

    def __init__(self) -> None:
        super().__init__()
        self.answer = asyncio.Event()

    async def asend(self, request: RunRequest) -> str:
        await self.answer.wait()
        raise ConnectionError("broker refused the connection")


async def test_an_append_does_not_wait_for_its_signal_and_a_refused_send_frees_the_mark(
        db_url: str, store: Store, config: Config, caplog: pytest.LogCaptureFixture) -> None:
    broker = RefusingEnqueuer()
    async with CompactdClient(config, store=store, enqueuer=broker) as client:
        handle = await client.create_session("s1", run_model="gpt-4o")
        await handle.append([user(TRIGGER - 20)])
        step = await handle.append([user(30)])
        # The append returned with its messages committed and the mark set while its send is
        # still held; the send then fails without touching what was appended.
        assert step.fired and step.signalled
        assert (await store.get_session("s1")).signal_at is not None
        broker.answer.set()
        with caplog.at_level(logging.WARNING, logger="compactd.scheduler.client"):
            await client.drain()
        assert "signal was not enqueued: broker refused the connection" in caplog.text
        info = await store.get_session("s1")
        assert info.signal_at is None, "the mark is cleared so the next append signals again"
        assert info.surface_messages == 2 and info.last_seq == 2
        assert (await handle.append([user(5)])).signalled
        assert (await store.get_session("s1")).signal_at is not None
    # Closing the client waited for that last send too: it failed and freed the mark.
    assert (await store.get_session("s1")).signal_at is None


async def test_a_send_cancelled_before_the_broker_had_it_frees_the_mark(
        db_url: str, store: Store, config: Config) -> None:
    broker = RefusingEnqueuer()  # never answers: the send is still waiting when cancelled
    client = CompactdClient(config, store=store, enqueuer=broker)
    handle = await client.create_session("s1", run_model="gpt-4o")
    await handle.append([user(TRIGGER - 20)])
    assert (await handle.append([user(30)])).signalled
    await asyncio.sleep(0.05)  # past the send's delay: waiting on the broker
    for task in list(client._sending):
        task.cancel()
    await client.aclose()
    assert (await store.get_session("s1")).signal_at is None
    assert (await store.get_session("s1")).last_seq == 2


class DownBroker(RecordingEnqueuer):
    """A broker that is down: every send is tried (counted) and refused, until it is back."""

    def __init__(self) -> None:
        super().__init__()
        self.tried = 0
        self.up = False

    async def asend(self, request: RunRequest) -> str:
        self.tried += 1
        if not self.up:
            raise ConnectionError("broker refused the connection")
        return await super().asend(request)


async def test_after_a_refused_send_the_next_signals_are_held_back_not_sent(
        db_url: str, store: Store, config: Config, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """While Redis is down each append over its trigger would start a send bound to fail, and a
    busy runtime's sends would queue without bound: after one is refused, the signals of the
    next seconds are held back (their marks freed; the sweep enqueues the sessions later)."""
    broker = DownBroker()
    async with CompactdClient(config, store=store, enqueuer=broker) as client:
        handles = [await client.create_session(f"s{k}", run_model="gpt-4o") for k in range(4)]
        for handle in handles:
            await handle.append([user(TRIGGER - 20)])
        with caplog.at_level(logging.WARNING, logger="compactd.scheduler.client"):
            assert (await handles[0].append([user(30)])).signalled
            await client.drain()
            for handle in handles[1:]:
                assert (await handle.append([user(30)])).signalled
                await client.drain()
                assert (await handle.append([user(5)])).signalled  # the mark was freed
                await client.drain()
        assert broker.tried == 1, "one send refused, the others held back"
        assert caplog.text.count("signal was not enqueued") == 1
        for handle in handles:
            info = await store.get_session(handle.id)
            assert info.signal_at is None and info.last_seq in (2, 3), info
        # Once the hold is over the next signal is sent again, and reaches a broker back up.
        monkeypatch.setattr(client_module, "BROKER_HOLD_S", 0.0)
        broker.up = True
        assert (await handles[1].append([user(5)])).signalled
        await client.drain()
    assert broker.tried == 2 and [r.session_id for r in broker.sent] == ["s1"]


async def test_report_usage_moves_the_trigger(client: CompactdClient, store: Store,
                                              enqueuer: RecordingEnqueuer) -> None:
    handle = await client.create_session("s1", run_model="gpt-4o")
    step = await handle.append([user(50)])
    assert not step.fired
    info = await handle.report_usage(TRIGGER - 1)
    await client.drain()
    assert info.reported_input_tokens == TRIGGER - 1 and enqueuer.sent == []
    info = await handle.report_usage(TRIGGER + 100)  # the provider counts more than we do
    await client.drain()
    assert len(enqueuer.sent) == 1
    assert (await handle.signal()).reason == "a compaction is already queued or running"
    with pytest.raises(InvalidMessage, match="input_tokens"):
        await handle.report_usage(-1)


async def test_poll_reports_a_commit_not_the_runtimes_own_appends(
        client: CompactdClient, config: Config, store: Store) -> None:
    handle = await client.create_session("s1", run_model="gpt-4o")
    for i in range(6):
        await handle.append(tool_step(80, f"t{i}"))
        assert await handle.poll() is None, "an own append is not news"
    outcome = await compact(deps_for(config, store), "s1", trigger="manual", force=True)
    assert outcome.outcome == "committed"
    moved = await handle.poll()
    assert moved is not None
    # An append after the commit must not hide it.
    await handle.append([user(5)])
    assert await handle.poll() is not None
    messages = await handle.surface()
    assert any((m.get("meta") or {}).get("checkpoint") for m in messages)
    assert await handle.poll() is None


async def test_a_burst_of_appends_over_the_trigger_puts_one_message_on_the_queue(
        clean_pg: str, clean_redis: str) -> None:
    import redis

    config = make_config(clean_pg, broker=clean_redis)
    async with CompactdClient(config, enqueuer=Enqueuer(client_app(config))) as client:
        handle = await client.create_session("s1", run_model="gpt-4o")
        await handle.append([user(TRIGGER - 20)])
        steps = await asyncio.gather(*(handle.append([user(30, f"b{i}")]) for i in range(30)))
    assert all(s.fired for s in steps)
    assert sum(s.signalled for s in steps) == 1
    r = redis.Redis.from_url(clean_redis)
    try:
        queued = r.lrange(QUEUE_PRESSURE, 0, -1)
    finally:
        r.close()
    assert len(queued) == 1
    message = json.loads(queued[0])
    assert message["headers"]["task"] == TASK_RUN
    _args, kwargs, _ = json.loads(base64.b64decode(message["body"]))
    assert (kwargs["session_id"], kwargs["trigger"]) == ("s1", "pressure")


# ------------------------------------------------------------------------------------------
# sweeps and the reaper


async def test_sweep_enqueues_only_idle_sessions_over_their_trigger(
        db_url: str, store: Store) -> None:
    config = make_config(db_url, worker={"sweep_batch": 2, "sweep_interval_s": 30})
    enqueuer = RecordingEnqueuer()
    now = utcnow()
    async with CompactdClient(config, store=store, enqueuer=enqueuer) as client:
        for sid in ("a-over", "c-leased", "d-cooling", "e-fresh", "f-stale"):
            await over(client, sid)
        under = await client.create_session("b-under", run_model="gpt-4o")
        await under.append([user(10)])
    claim = await store.claim("c-leased", owner="other", trigger="manual", lease_s=300)
    assert isinstance(claim, Claim)
    await store.flag_session("d-cooling", reason="test",
                             cooldown_until=now + dt.timedelta(minutes=5))
    assert await store.mark_signal("e-fresh", ttl_s=120, now=now - dt.timedelta(seconds=5))
    assert await store.mark_signal("f-stale", ttl_s=120, now=now - dt.timedelta(seconds=31))
    result = await sweep_pressure(store, config, enqueuer, now=now)
    assert sorted(result.enqueued) == ["a-over", "f-stale"]
    # Only the two idle sessions over their trigger are read (leased, cooling and freshly
    # signalled ones are passed over in SQL): one full batch of two, then an empty one.
    assert result.scanned_batches == 2 and result.resolved == 6
    assert {r.trigger for r in enqueuer.sent} == {"sweep"}
    # The sweep marked what it enqueued: the next sweep does not enqueue them twice.
    again = await sweep_pressure(store, config, enqueuer, now=now + dt.timedelta(seconds=1))
    assert again.enqueued == ()


@pytest.mark.timed
async def test_sweep_skips_a_row_another_transaction_holds(clean_pg: str) -> None:
    config = make_config(clean_pg)
    enqueuer = RecordingEnqueuer()
    store = Store.from_url(clean_pg)
    try:
        async with CompactdClient(config, store=store, enqueuer=enqueuer) as client:
            await over(client, "held")
            await over(client, "free")
        async with store.engine.connect() as conn, conn.begin():
            await conn.execute(sa.text("SELECT id FROM sessions WHERE id = 'held' FOR UPDATE"))
            started = time.monotonic()
            result = await sweep_pressure(store, config, enqueuer)
            assert time.monotonic() - started < 5, "the sweep waited for the lock"
        assert result.enqueued == ("free",)
        assert (await sweep_pressure(store, config, enqueuer)).enqueued == ("held",)
    finally:
        await store.close()


async def test_reaper_abandons_expired_runs_and_requeues_sessions_still_over(
        client: CompactdClient, store: Store, config: Config,
        enqueuer: RecordingEnqueuer) -> None:
    await over(client, "hot")
    await over(client, "flagged")
    cool = await client.create_session("cool", run_model="gpt-4o")
    await cool.append([user(10)])
    t0 = utcnow()
    await store.flag_session("flagged", reason="test", cooldown_until=t0 + dt.timedelta(
        minutes=5))
    claims = [await store.claim(sid, owner="dead-worker", trigger="manual", lease_s=5, now=t0)
              for sid in ("hot", "cool", "flagged")]
    assert all(isinstance(c, Claim) for c in claims)
    assert await reap_leases(store, config, enqueuer, now=t0 + dt.timedelta(seconds=1)) == []
    reaped = await reap_leases(store, config, enqueuer, now=t0 + dt.timedelta(seconds=6))
    assert sorted(r.session_id for r in reaped) == ["cool", "flagged", "hot"]
    # Over its trigger: back on the queue; under it, or cooling down: not.
    assert [(r.session_id, r.trigger) for r in enqueuer.sent] == [("hot", "reap")]
    for claim in claims:
        assert isinstance(claim, Claim)
        run = await store.get_run(claim.run_id)
        assert run is not None and (run.status, run.failure_class) == ("failed", "abandoned")
        info = await store.get_session(claim.session.id)
        assert info.lease_run_id is None
        ends = await store.read_events(claim.session.id, kinds=[JournalKind.END])
        assert [e.payload["failure_class"] for e in ends] == ["abandoned"]
        assert (await store.verify(claim.session.id)).ok


# ------------------------------------------------------------------------------------------
# follow-up signals after a run


async def test_follow_up_signals_only_for_appends_made_during_the_run(
        client: CompactdClient, store: Store, config: Config,
        enqueuer: RecordingEnqueuer) -> None:
    await over(client)
    # What the worker does when a run ends: clear the mark, and check with what that returns.
    info = await store.clear_signal("s1")
    assert info is not None and info.id == "s1" and info.signal_at is None
    appended_at = info.last_append_at
    assert appended_at is not None
    # Nothing appended since the run started: a run that left the session over its trigger
    # does not re-enqueue itself.
    assert await follow_up(store, config, enqueuer, info,
                           run_started_at=appended_at + dt.timedelta(seconds=1)) is None
    assert await follow_up(store, config, enqueuer, info,
                           run_started_at=appended_at - dt.timedelta(seconds=1)) is not None
    assert [r.trigger for r in enqueuer.sent] == ["pressure"]
    # Its mark is live now: a second follow-up (or signal) does not add a task.
    assert await follow_up(store, config, enqueuer, info,
                           run_started_at=appended_at - dt.timedelta(seconds=1)) is None
    assert len(enqueuer.sent) == 1


async def test_a_follow_up_takes_over_a_mark_older_than_signal_ttl_s(
        client: CompactdClient, store: Store, db_url: str,
        enqueuer: RecordingEnqueuer) -> None:
    """The mark another signal left (its task lost) holds a follow-up back while it is younger
    than ``worker.signal_ttl_s``, and no longer."""
    await over(client)
    info = await store.clear_signal("s1")
    assert info is not None and info.last_append_at is not None
    started = info.last_append_at - dt.timedelta(seconds=1)
    assert await store.mark_signal("s1", ttl_s=1.0, now=utcnow() - dt.timedelta(seconds=100))
    assert await follow_up(store, make_config(db_url, worker={"signal_ttl_s": 1000}), enqueuer,
                           info, run_started_at=started) is None
    assert enqueuer.sent == []
    assert await follow_up(store, make_config(db_url, worker={"signal_ttl_s": 50}), enqueuer,
                           info, run_started_at=started) is not None
    assert [r.trigger for r in enqueuer.sent] == ["pressure"]


# ------------------------------------------------------------------------------------------
# loop guard


async def test_loop_guard_flags_a_session_compacting_without_relief(
        db_url: str, store: Store) -> None:
    # clear_at_least 0: every summary is asked for, as before a summary that cannot relieve
    # waited for one that frees that much (cache_breaks.summary_wasted), so the runs commit.
    config = make_config(db_url, worker={"loop_guard": {
        "max_compactions": 2, "window_s": 60, "margin": 0.1, "cooldown_s": 30}},
        summarization={"clear_at_least": 0})
    enqueuer = RecordingEnqueuer()
    deps = deps_for(config, store)
    # The envelope alone is over the trigger: no compaction can bring relief.
    envelope = {"system": text(TRIGGER + 30, "sys")}
    async with CompactdClient(config, store=store, enqueuer=enqueuer) as client:
        handle = await client.create_session("s1", run_model="gpt-4o", envelope=envelope)
        outcomes = []
        for round_no in range(4):
            for i in range(2):
                await handle.append(tool_step(200, f"r{round_no}m{i}"))
            info = await store.get_session("s1")
            if info.cooldown_until is not None:
                break
            outcomes.append(await compact(deps, "s1", trigger="pressure"))
        assert [o.outcome for o in outcomes] == ["committed"] * 3
        info = await store.get_session("s1")
        assert info.flagged_reason is not None and "without pressure falling" in \
            info.flagged_reason
        assert info.cooldown_until is not None
        assert dt.timedelta(seconds=25) < info.cooldown_until - utcnow() <= dt.timedelta(
            seconds=30)
        body = await status(store)
        assert [f["session"] for f in body["flagged"]] == ["s1"]
        # Cooled down: neither signals, appends nor sweeps enqueue it (with its signal mark
        # free, as when the last run ended, so only the cool-down can be what stops them).
        await client.drain()
        assert len(enqueuer.sent) == 1  # the first append, before any run
        await store.clear_signal("s1")
        assert "cooling down" in (await handle.signal()).reason
        step = await handle.append([user(10)])
        assert step.fired and not step.signalled
        assert (await sweep_pressure(store, config, enqueuer)).enqueued == ()
        await client.drain()
        assert len(enqueuer.sent) == 1
        # Relief clears the flag: a small envelope, and a run that gets well under the trigger.
        await client.create_session("s1", run_model="gpt-4o", envelope={"system": "short"})
        await handle.append([user(10, "small"), {"role": "assistant", "content": "ok"}])
        done = await compact(deps, "s1", trigger="pressure")
        assert done.outcome == "committed"
        assert done.tokens_after is not None and done.tokens_after < TRIGGER * 0.9
        info = await store.get_session("s1")
        assert (info.flagged_reason, info.cooldown_until) == (None, None)
        assert (await status(store))["flagged"] == []


async def test_loop_guard_leaves_manual_runs_alone(db_url: str, store: Store) -> None:
    config = make_config(db_url, worker={"loop_guard": {"max_compactions": 1}})
    deps = deps_for(config, store)
    envelope = {"system": text(TRIGGER + 30, "sys")}
    await store.create_session("s1", run_model="gpt-4o", envelope=envelope)
    for round_no in range(3):
        for i in range(2):
            await store.append("s1", [parsed(m) for m in tool_step(200, f"r{round_no}m{i}")])
        assert (await compact(deps, "s1", trigger="manual")).outcome == "committed"
    assert (await store.get_session("s1")).flagged_reason is None


# ------------------------------------------------------------------------------------------
# bulk items


async def test_bulk_items_move_pending_enqueued_done_and_resume_skips_done(
        client: CompactdClient, store: Store, config: Config) -> None:
    ids = [f"b{i}" for i in range(4)]
    for sid in ids:
        handle = await client.create_session(sid, run_model="gpt-4o")
        for i in range(4):
            await handle.append(tool_step(60, f"{sid}m{i}"))
    job = await store.create_bulk_job(filter={"tenant": "default"}, session_ids=ids, force=True,
                                      rate_per_s=100.0)
    assert (job.matched, job.pending, job.enqueued, job.done) == (4, 4, 0, 0)
    recorder = RecordingEnqueuer()
    started = time.monotonic()
    sent = await fan_out(store, recorder, job, states=[ItemState.PENDING], force=True,
                         rate_per_s=100.0, chunk=3)
    assert sent == 4 and time.monotonic() - started >= 3 / 100 * 0.9  # paced at the rate
    assert [(r.session_id, r.trigger, r.bulk_job_id, r.force) for r in recorder.sent] == [
        (sid, "bulk", job.id, True) for sid in ids]
    job = await store.get_bulk_job(job.id)
    assert job is not None and (job.pending, job.enqueued, job.done) == (0, 4, 0)

    deps = deps_for(config, store)
    first = await compact(deps, "b0", trigger="bulk", force=True, bulk_job_id=job.id)
    assert first.outcome == "committed"
    # A second delivery of the same item compacts nothing and records no run.
    again = await compact(deps, "b0", trigger="bulk", force=True, bulk_job_id=job.id)
    assert (again.outcome, again.run_id) == ("nothing_to_do", None)
    assert again.error is not None and "already finished" in again.error
    runs = [r for r in await store.session_runs("b0") if r.bulk_job_id == job.id]
    assert [r.status for r in runs] == ["committed"]

    await store.mark_bulk_items(job.id, ["b1"], ItemState.FAILED, from_states=[ItemState.ENQUEUED])
    # A state moves only from the states named: b0 is done, b1 failed meanwhile.
    await store.mark_bulk_items(job.id, ["b0", "b1"], ItemState.ENQUEUED,
                                from_states=[ItemState.PENDING])
    with pytest.raises(ValueError, match="does not move"):
        await store.mark_bulk_items(job.id, ["b0"], ItemState.ENQUEUED,
                                    from_states=[ItemState.DONE])
    job = await store.get_bulk_job(job.id)
    assert job is not None and (job.done, job.failed, job.enqueued) == (1, 1, 4)
    resumed = RecordingEnqueuer()
    await fan_out(store, resumed, job,
                  states=[ItemState.PENDING, ItemState.ENQUEUED, ItemState.FAILED], force=True,
                  rate_per_s=None, chunk=100)
    assert [r.session_id for r in resumed.sent] == ["b1", "b2", "b3"]
    assert await store.bulk_items(job.id, states=[ItemState.DONE], limit=10) == ["b0"]

    listed = (await status(store))["bulk_jobs"]
    assert [(j["id"], j["matched"], j["done"], j["failed"], j["pending"]) for j in listed] == [
        (job.id, 4, 1, 0, 0)]


def turns(count: int, tokens: int, tag: str) -> list[dict[str, Any]]:
    """``count`` plain messages, user and assistant in turn, of ``tokens`` tokens each."""
    return [{"role": ("user", "assistant")[i % 2], "content": text(tokens, f"{tag}t{i}")}
            for i in range(count)]


async def test_a_bulk_item_under_its_trigger_is_skipped_and_force_keeps_the_policy_tail(
        store: Store, db_url: str) -> None:
    config = make_config(db_url, trigger=4000, keep=6)
    deps = deps_for(config, store)
    for sid, tokens in (("over", 400), ("under", 150)):
        await store.create_session(sid, run_model="gpt-4o")
        await store.append(sid, [parsed(m) for m in turns(12, tokens, sid)])
    job = await store.create_bulk_job(filter={}, session_ids=["over", "under"], force=False,
                                      rate_per_s=None)
    assert (await compact(deps, "over", trigger="bulk", bulk_job_id=job.id)).outcome == \
        "committed"
    assert (await compact(deps, "under", trigger="bulk", bulk_job_id=job.id)).outcome == \
        "nothing_to_do"
    ended = await store.get_bulk_job(job.id)
    assert ended is not None
    # Nothing was compacted in "under": it is skipped, not done.
    assert (ended.done, ended.skipped, ended.failed, ended.enqueued) == (1, 1, 0, 2)
    assert await store.bulk_items(job.id, states=[ItemState.SKIPPED], limit=10) == ["under"]
    [listed] = (await status(store))["bulk_jobs"]
    assert (listed["done"], listed["skipped"]) == (1, 1)

    # --force ignores the trigger and keeps what the keep policy names (6 messages), not one
    # turn: a bulk job re-applies the policy.
    before = await store.read_surface("under")
    forced = await store.create_bulk_job(filter={}, session_ids=["under"], force=True,
                                         rate_per_s=None)
    assert (await compact(deps, "under", trigger="bulk", force=True,
                          bulk_job_id=forced.id)).outcome == "committed"
    after = await store.read_surface("under")
    kept = [n.seq for n in after.nodes if n.kind == "message"]
    assert kept == before.seqs[-6:], kept
    assert (await store.get_bulk_job(forced.id)).done == 1  # type: ignore[union-attr]


async def test_recompact_filters_select_sessions(store: Store, tmp_path: Any) -> None:
    now = utcnow()
    for sid, tenant, model, tokens, idle_h in [
        ("a-big", "acme", "gpt-4o", 500, 0), ("b-small", "acme", "claude-3-5-sonnet", 50, 0),
        ("c-idle", "globex", "gpt-4o", 800, 3), ("d-empty", "globex", "gpt-4o", 0, 0)]:
        await store.create_session(sid, tenant=tenant, run_model=model)
        if tokens:
            await store.append(sid, [parsed(user(tokens))],
                               now=now - dt.timedelta(hours=idle_h))
    session_file = tmp_path / "ids.txt"
    session_file.write_text("c-idle\n\n  a-big  \nghost\n")
    for bulk_filter, expected in [
        (BulkFilter(), ["a-big", "b-small", "c-idle", "d-empty"]),
        (BulkFilter(tenant="acme"), ["a-big", "b-small"]),
        (BulkFilter(run_model="gpt-4o"), ["a-big", "c-idle", "d-empty"]),
        (BulkFilter(min_tokens=400), ["a-big", "c-idle"]),
        (BulkFilter(idle_for_s=3600), ["c-idle", "d-empty"]),  # never appended counts as idle
        (BulkFilter(session_file=str(session_file)), ["a-big", "c-idle"]),
        (BulkFilter(tenant="acme", min_tokens=400, run_model="gpt-4o"), ["a-big"]),
    ]:
        assert await matching_sessions(store, bulk_filter) == expected, bulk_filter
    with pytest.raises(InvalidMessage, match="cannot read"):
        await matching_sessions(store, BulkFilter(session_file=str(tmp_path / "missing")))


# ------------------------------------------------------------------------------------------
# the shared rate meter


async def test_the_redis_meter_spaces_calls_across_workers(redis_url: str) -> None:
    import redis.asyncio as aioredis

    clock = [1_000_000.0]
    a, b = aioredis.from_url(redis_url), aioredis.from_url(redis_url)
    try:
        worker_a = RedisLimiter(a, clock=lambda: clock[0])
        worker_b = RedisLimiter(b, clock=lambda: clock[0])
        meter = f"test:{uuid.uuid4().hex}"
        waits = [await (worker_a if i % 2 else worker_b).acquire(meter, 50.0) for i in range(5)]
        # Five calls at one instant from two workers take consecutive slots 1/50 s apart (and
        # the jitter margin).
        slot = (1 + JITTER_MARGIN) / 50
        assert waits == pytest.approx([0.0, slot, 2 * slot, 3 * slot, 4 * slot], abs=1e-6)
        clock[0] += 10.0  # an idle meter does not bank a burst
        assert await worker_a.acquire(meter, 50.0) == 0.0
        assert await worker_b.acquire(meter, 50.0) == pytest.approx(slot, abs=1e-6)
    finally:
        await a.aclose()
        await b.aclose()
