"""Deleting a session, retention's purge and the log's export, on PostgreSQL and SQLite: sessions
appended and compacted by the orchestration a worker runs (local summarizer), with every kind of
row a session can have, then deleted through the client."""

from __future__ import annotations

import datetime as dt
import types
from collections.abc import AsyncIterator
from typing import Any

import pytest
import sqlalchemy as sa

from compactd.scheduler.client import CompactdClient
from compactd.scheduler.samples import coding_session
from compactd.storage import deletion
from compactd.storage import schema as t
from compactd.storage.connectors import SQLiteConnector
from compactd.storage.database import snapshot, transaction
from compactd.storage.deletion import DELETER, SESSION_TABLES
from compactd.storage.errors import LeaseLost, SessionNotFound
from compactd.storage.messages import parse_openai
from compactd.storage.records import Claim, Replacement, utcnow
from compactd.storage.store import Store
from compactd.worker.orchestration import compact
from compactd.worker.retention import RETENTION_RUN, purge_expired
from compactd.worker.runtime import Deps, open_deps
from compactd.worker.settings import RetentionConfig, Settings, build_config
from tests.support.tables import session_row_counts, session_tables

POLICY = {"trigger": [{"type": "tokens", "value": 20_000}],
          "keep": {"type": "messages", "value": 12}}


async def _full_session(deps: Deps, session_id: str, tenant: str) -> None:
    """A session with a row in every table a session has rows in: its log and surface, tool
    calls, a committed compaction (run, journal, recall nodes and originals, indexed), a queued
    manual request, a bulk job's item, a pending signal and an append's idempotency key."""
    store = deps.store
    await store.create_session(session_id, tenant=tenant, context_window=128_000, policy=POLICY)
    await store.append(session_id, [parse_openai(m) for m in coding_session(steps=40).messages],
                       idempotency_key=f"step-{session_id}")
    outcome = await compact(deps, session_id, trigger="pressure")
    assert outcome.outcome == "committed", outcome.to_json()
    await store.mark_manual(session_id, f"task-{session_id}", ttl_s=60)
    await store.create_bulk_job(filter={}, session_ids=[session_id], force=True, rate_per_s=None)
    await store.mark_signal(session_id, ttl_s=60)


@pytest.fixture
async def deps(db_url: str) -> AsyncIterator[Deps]:
    config = build_config({}, settings=Settings(database_url=db_url, broker_url="memory://"))
    async with open_deps(config, owner="deletion-test") as handle:
        yield handle


async def test_after_delete_no_row_of_the_session_remains_in_any_table(deps: Deps) -> None:
    store = deps.store
    await _full_session(deps, "gone", "acme")
    await _full_session(deps, "kept", "acme")
    tables = await session_tables(store)
    # Every table of the schema holding a session's rows is one the deletion walks.
    schema_tables = {table.name for table in t.metadata.sorted_tables if "session_id" in table.c}
    assert schema_tables == {table.name for table in SESSION_TABLES}
    assert schema_tables <= tables.keys()
    before = await session_row_counts(store, "gone")
    populated = {name for name, n in before.items() if n}
    # The session really had rows everywhere the schema has room for them.
    assert populated == set(tables), sorted(set(tables) - populated)
    assert schema_tables | {"sessions"} <= populated
    kept = await session_row_counts(store, "kept")

    async with CompactdClient(deps.config, store=store) as client:
        result = await client.delete("gone")
    assert result.rows["events"] == before["events"] and result.rows["sessions"] == 1

    after = await session_row_counts(store, "gone")
    assert after == dict.fromkeys(tables, 0), {k: n for k, n in after.items() if n}
    assert await session_row_counts(store, "kept") == kept
    assert (await store.verify("kept")).ok
    with pytest.raises(SessionNotFound):
        await store.get_session("gone")
    # The id is free again: a new session of that name starts empty.
    await store.create_session("gone", tenant="globex")
    assert (await store.get_session("gone")).surface_messages == 0


async def test_a_deletion_in_small_batches_deletes_the_same(deps: Deps) -> None:
    store = deps.store
    await _full_session(deps, "gone", "acme")
    tables = await session_tables(store)
    result = await store.delete_session("gone", batch=3)
    assert result.rows["events"] > 3 * 10
    assert await session_row_counts(store, "gone") == dict.fromkeys(tables, 0)


async def test_another_tenants_session_is_not_found_and_nothing_is_deleted(deps: Deps) -> None:
    store = deps.store
    await _full_session(deps, "theirs", "acme")
    before = await session_row_counts(store, "theirs")
    async with CompactdClient(deps.config, store=store) as client:
        with pytest.raises(SessionNotFound):
            await client.delete("theirs", tenant="globex")
        with pytest.raises(SessionNotFound):
            await client.delete("nobody", tenant="acme")
    assert await session_row_counts(store, "theirs") == before
    assert (await store.get_session("theirs")).lease_owner is None


async def _claimed(store: Store, session_id: str) -> Claim:
    await store.create_session(session_id)
    await store.append(session_id, [parse_openai({"role": "user", "content": f"m{i}"})
                                     for i in range(6)])
    claim = await store.claim(session_id, owner="w1", trigger="manual", lease_s=60)
    assert isinstance(claim, Claim)
    return claim


async def test_a_claimed_run_is_cancelled_and_its_commit_is_refused(store: Store) -> None:
    claim = await _claimed(store, "busy")
    surface = await store.read_surface("busy")
    # The deletion stops before its final transaction: the run's commit meets its fence.
    await store._begin_delete("busy", tenant=None, now=utcnow(), idle_before=None)
    run = await store.get_run(claim.run_id)
    assert run is not None and (run.status, run.failure_class) == ("failed", "cancelled")
    info = await store.get_session("busy")
    assert info.lease_owner == DELETER and info.lease_fence == claim.fence + 1
    assert not await store.renew("busy", run_id=claim.run_id, fence=claim.fence, lease_s=60)
    replacement = Replacement(seqs=(1, 2), kind="checkpoint", journal_kind="compaction/summary",
                              payload={"message": {"role": "user", "content": "s"}}, tokens=1)
    with pytest.raises(LeaseLost):
        await store.commit("busy", run_id=claim.run_id, fence=claim.fence,
                           replacements=[replacement], now=utcnow())
    assert (await store.read_surface("busy")).nodes == surface.nodes
    # A new claim finds the deletion's lease, not a free session.
    assert not isinstance(await store.claim("busy", owner="w2", trigger="manual", lease_s=60),
                          Claim)


async def test_a_commit_after_the_deletion_finds_no_session(store: Store) -> None:
    claim = await _claimed(store, "busy")
    result = await store.delete_session("busy")
    assert result.cancelled_run == claim.run_id
    replacement = Replacement(seqs=(1, 2), kind="checkpoint", journal_kind="compaction/summary",
                              payload={"message": {"role": "user", "content": "s"}}, tokens=1)
    with pytest.raises(SessionNotFound):
        await store.commit("busy", run_id=claim.run_id, fence=claim.fence,
                           replacements=[replacement], now=utcnow())
    assert await session_row_counts(store, "busy") == dict.fromkeys(await session_tables(store), 0)


async def test_appends_during_a_deletion_are_deleted_with_it(store: Store) -> None:
    await store.create_session("live")
    await store.append("live", [parse_openai({"role": "user", "content": "a"})] * 5)
    await store._begin_delete("live", tenant=None, now=utcnow(), idle_before=None)
    await store.append("live", [parse_openai({"role": "user", "content": "b"})] * 5)
    await store.delete_session("live", batch=2)
    assert await session_row_counts(store, "live") == dict.fromkeys(await session_tables(store), 0)


async def test_each_batch_is_followed_by_the_backends_pause(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """On SQLite the deletion sleeps after every batch (the appends queued behind it go first);
    on PostgreSQL it never does."""
    await store.create_session("big")
    await store.append("big", [parse_openai({"role": "user", "content": f"m{i}"})
                               for i in range(50)])
    pauses: list[float] = []

    async def sleep(seconds: float) -> None:
        pauses.append(seconds)

    monkeypatch.setattr(deletion, "asyncio", types.SimpleNamespace(sleep=sleep), raising=False)
    await store.delete_session("big", batch=10)
    if store.engine.dialect.name == "sqlite":
        # A pause per batch: the log's and the surface's full batches and their last, partial
        # one, and one batch for each other table, in the first pass alone.
        assert len(pauses) >= 2 * 6 + len(SESSION_TABLES) - 2, pauses
        assert all(p >= SQLiteConnector.deletion_pace.rest_s for p in pauses), pauses
    else:
        assert pauses == []
    assert await session_row_counts(store, "big") == dict.fromkeys(await session_tables(store), 0)


async def _age(store: Store, session_id: str, days: float) -> None:
    """Move the session's appends ``days`` into the past."""
    then = utcnow() - dt.timedelta(days=days)
    async with transaction(store.engine) as conn:
        await conn.execute(t.events.update().where(t.events.c.session_id == session_id)
                           .values(created_at=then))
        await conn.execute(t.sessions.update().where(t.sessions.c.id == session_id)
                           .values(last_append_at=then, created_at=then))


async def _originals(store: Store, session_id: str) -> int:
    async with snapshot(store.engine) as conn:
        return int((await conn.execute(sa.select(sa.func.count()).select_from(t.recall_originals)
                                       .where(t.recall_originals.c.session_id == session_id))
                    ).scalar() or 0)


async def test_retention_purges_old_originals_and_idle_sessions_only(deps: Deps) -> None:
    store = deps.store
    for sid in ("old", "idle", "fresh"):
        await _full_session(deps, sid, "acme")
        await store.clear_manual(sid, f"task-{sid}")
    await _age(store, "old", 10)
    await _age(store, "idle", 40)
    fresh = await session_row_counts(store, "fresh")
    old_rows = await session_row_counts(store, "old")
    idle_originals = await _originals(store, "idle")
    assert await _originals(store, "old") > 0

    result = await purge_expired(store, RetentionConfig(originals_days=7, sessions_idle_days=30))

    # The idle session's originals are older than the originals' limit too.
    assert result.sessions == 1
    assert result.originals == old_rows["recall_originals"] + idle_originals
    assert await _originals(store, "old") == 0
    # Nothing else of the old session went: its log still replays.
    assert {k: n for k, n in (await session_row_counts(store, "old")).items()
            if k not in ("recall_originals", "recall_fts")} == {
        k: n for k, n in old_rows.items() if k not in ("recall_originals", "recall_fts")}
    assert (await store.verify("old")).ok
    assert await session_row_counts(store, "idle") == dict.fromkeys(await session_tables(store), 0)
    assert await session_row_counts(store, "fresh") == fresh
    [run] = await store.beat_runs([RETENTION_RUN])
    assert run.result == result.to_json()
    assert (utcnow() - run.finished_at).total_seconds() < 60


async def test_retention_leaves_a_session_that_appended_after_it_was_picked(store: Store) -> None:
    await store.create_session("back")
    await store.append("back", [parse_openai({"role": "user", "content": "a"})])
    await _age(store, "back", 40)
    idle_before = utcnow() - dt.timedelta(days=30)
    assert await store.idle_sessions(idle_before=idle_before, limit=10) == ["back"]
    await store.append("back", [parse_openai({"role": "user", "content": "b"})])
    assert await store.delete_session("back", idle_before=idle_before) is None
    assert (await store.get_session("back")).surface_messages == 2


async def test_export_pages_return_the_log_as_appended(store: Store) -> None:
    messages: list[dict[str, Any]] = [{"role": "user", "content": f"m{i}\x00é"} for i in range(5)]
    await store.create_session("x")
    await store.append("x", [parse_openai(m) for m in messages])
    first = await store.export_messages("x", limit=3)
    rest = await store.export_messages("x", after_seq=first[-1][0], limit=3)
    assert [m for _, m in first + rest] == messages
    with pytest.raises(SessionNotFound):
        await store.export_messages("nobody")
