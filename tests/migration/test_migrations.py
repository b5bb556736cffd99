"""Migrations applied to an empty database give exactly the models: ``alembic check`` finds no
drift, on PostgreSQL and on SQLite."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from compactd.storage.migrate import check, upgrade
from tests.support.services import create_database_sync, drop_database_sync, with_database


@pytest.fixture
def empty_pg(pg_url: str):  # type: ignore[no-untyped-def]
    url = with_database(pg_url, f"compactd_mig_{uuid.uuid4().hex[:8]}")
    create_database_sync(url)
    yield url
    drop_database_sync(url)


def test_upgrade_then_check_on_empty_postgres(empty_pg: str) -> None:
    upgrade(empty_pg)
    check(empty_pg)
    upgrade(empty_pg)  # idempotent


def test_upgrade_then_check_on_empty_sqlite(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'm.sqlite3'}"
    upgrade(url)
    check(url)


def test_check_reports_to_the_stdout_of_its_call(tmp_path: Path) -> None:
    """Alembic binds its default stdout when first imported; a check run after that stream was
    swapped and closed (a test capture, a redirect) still reports, to the current stdout."""
    import contextlib
    import io

    url = f"sqlite:///{tmp_path / 'out.sqlite3'}"
    upgrade(url)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        check(url)
    assert out.getvalue() == "No new upgrade operations detected.\n"


def test_check_fails_on_drift(tmp_path: Path) -> None:
    """The check is real: a database that lost an index no longer matches the models."""
    import sqlite3

    path = tmp_path / "drift.sqlite3"
    upgrade(f"sqlite:///{path}")
    with sqlite3.connect(path) as conn:
        conn.execute("DROP INDEX ix_sessions_tenant")
    with pytest.raises(Exception, match="New upgrade operations detected"):
        check(f"sqlite:///{path}")


def test_head_constant_matches_alembic(tmp_path: Path) -> None:
    from alembic.script import ScriptDirectory

    from compactd.storage.migrate import HEAD_REVISION, alembic_config

    scripts = ScriptDirectory.from_config(alembic_config(f"sqlite:///{tmp_path / 'x.sqlite3'}"))
    assert scripts.get_current_head() == HEAD_REVISION


def test_code_newer_than_the_schema_says_run_migrate(empty_pg: str) -> None:
    """A database left at the revision before the claim function: the claim names the fix
    instead of failing with a driver error; after the upgrade it works."""
    import asyncio

    from compactd.storage.errors import SchemaMissing
    from compactd.storage.records import Claim
    from compactd.storage.store import Store

    # Every revision adds to the sessions row the code reads, so the function is dropped from a
    # current schema rather than the schema being left at the revision before it.
    upgrade(empty_pg)
    _execute(empty_pg, "DROP FUNCTION compactd_claim_v2")

    async def claim() -> object:
        store = Store.from_url(empty_pg)
        try:
            await store.create_session("s1")
            return await store.claim("s1", owner="w1", trigger="manual", lease_s=30)
        finally:
            await store.close()

    with pytest.raises(SchemaMissing, match="compactd migrate"):
        asyncio.run(claim())
    from alembic import command

    from compactd.storage.migrate import alembic_config

    # Revision 0019 creates the claim this code calls: undone and done again, it restores it.
    command.downgrade(alembic_config(empty_pg), "0018")
    upgrade(empty_pg)

    async def claim_again() -> object:
        store = Store.from_url(empty_pg)
        try:
            await store.create_session("s1")
            return await store.claim("s1", owner="w1", trigger="manual", lease_s=30)
        finally:
            await store.close()

    assert isinstance(asyncio.run(claim_again()), Claim)


def test_a_commit_on_a_schema_without_the_commit_function_says_run_migrate(empty_pg: str
                                                                           ) -> None:
    """At revision 0003 the claim works and both kinds of commit (with and without the end of
    the run) name the fix; the run is untouched."""
    import asyncio

    from compactd.storage.errors import SchemaMissing
    from compactd.storage.records import Claim, Replacement, RunEnd
    from compactd.storage.store import Store

    upgrade(empty_pg)
    _execute(empty_pg, "DROP FUNCTION compactd_commit_v4")

    async def attempt() -> None:
        store = Store.from_url(empty_pg)
        try:
            await store.create_session("s1")
            claim = await store.claim("s1", owner="w1", trigger="manual", lease_s=30)
            assert isinstance(claim, Claim)
            rep = Replacement(seqs=(1,), kind="pruned", payload={"role": "user", "content": ""},
                              tokens=1, journal_kind="compaction/prune")
            for end in (None, RunEnd(outcome="committed")):
                with pytest.raises(SchemaMissing, match="compactd migrate"):
                    await store.commit("s1", run_id=claim.run_id, fence=claim.fence,
                                       replacements=[rep], end=end)
            run = await store.get_run(claim.run_id)
            assert run is not None and run.status == "running"
        finally:
            await store.close()

    asyncio.run(attempt())


def test_a_schema_missing_a_column_says_run_migrate(empty_pg: str, tmp_path: Path) -> None:
    """A database one revision behind (no sweep thresholds yet): reading a session names the fix
    instead of quoting the driver's error, on both backends."""
    import asyncio

    from compactd.storage.errors import SchemaMissing
    from compactd.storage.store import Store

    async def create(url: str) -> None:
        store = Store.from_url(url)
        try:
            await store.get_session("s1")
        finally:
            await store.close()

    for url in (empty_pg, f"sqlite:///{tmp_path / 'old.sqlite3'}"):
        upgrade(url, "0004")
        with pytest.raises(SchemaMissing, match="compactd migrate") as caught:
            asyncio.run(create(url))
        assert "sweep" not in str(caught.value) and "SELECT" not in str(caught.value)


def _execute(url: str, sql: str) -> None:
    import asyncio

    import asyncpg

    async def run() -> None:
        conn = await asyncpg.connect(url)
        try:
            await conn.execute(sql)
        finally:
            await conn.close()

    asyncio.run(run())


def test_revision_0013_gives_compacted_sessions_their_current_version(tmp_path: Path) -> None:
    """A usage report built before the upgrade on a session already compacted is refused as
    before (its compacted version is the current one); a session never compacted has none.
    (A downgrade past 0014 is refused, so the sessions are written at 0012 itself.)"""
    import sqlite3

    path = tmp_path / "m.sqlite3"
    url = f"sqlite:///{path}"
    upgrade(url, "0012")
    with sqlite3.connect(path) as conn:
        for sid in ("compacted", "plain"):
            conn.execute("INSERT INTO sessions (id, tenant, envelope_tokens, surface_version,"
                         " surface_tokens, surface_messages, last_seq, last_position,"
                         " lease_fence, created_at) VALUES (?, 't', 0, 1, 1, 1, 1, 1, 0,"
                         " '2026-12-06 00:00:00')", (sid,))
        conn.execute("INSERT INTO events (session_id, seq, kind, payload, tokens, created_at)"
                     " VALUES ('compacted', 99, 'pruned', '{}', 1, '2026-12-06 00:00:00')")
    upgrade(url)
    with sqlite3.connect(path) as conn:
        rows = dict(conn.execute("SELECT id, compacted_version FROM sessions").fetchall())
    assert rows == {"compacted": 1, "plain": None}
