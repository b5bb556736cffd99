"""storage.online_migrations, run as a revision's body runs (one transaction per revision) on a
populated database: a column added without rewriting the table (PostgreSQL's relfilenode stays;
the kinds that rewrite are refused, and one is shown to rewrite), a backfill whose every batch
another connection sees committed before the next, an index built and dropped CONCURRENTLY."""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic.operations import Operations
from alembic.runtime.migration import MigrationContext
from sqlalchemy import event

from compactd.storage import online_migrations as online
from compactd.storage.database import create_engine
from compactd.storage.migrate import upgrade
from tests.support.services import create_database_sync, drop_database_sync, with_database

ROWS = 2500


@pytest.fixture(params=["sqlite", "postgres"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'online.sqlite3'}"
        upgrade(url)
        yield url
        return
    pg = with_database(request.getfixturevalue("pg_url"), f"compactd_onl_{uuid.uuid4().hex[:8]}")
    create_database_sync(pg)
    upgrade(pg)
    yield pg
    drop_database_sync(pg)


def _as_revision(url: str, body: Callable[[], None]) -> list[str]:
    """Run ``body`` as migrations/env.py runs a revision; the statements it sent."""
    sent: list[str] = []

    async def run() -> None:
        engine = create_engine(url, pool_size=1)
        event.listen(engine.sync_engine, "before_cursor_execute",
                     lambda _c, _cur, statement, *_a: sent.append(statement))
        try:
            async with engine.connect() as conn:
                def sync(connection: sa.Connection) -> None:
                    context = MigrationContext.configure(
                        connection, opts={"transaction_per_migration": True})
                    with Operations.context(context), context.begin_transaction(
                            _per_migration=True):
                        body()
                await conn.run_sync(sync)
                await conn.commit()
        finally:
            await engine.dispose()

    asyncio.run(run())
    return sent


def _query(url: str, statement: str) -> object:
    """One value, read on a connection of its own (in a thread: the caller may be inside a
    revision on the event loop)."""
    result: list[object] = []

    async def read() -> None:
        engine = create_engine(url, pool_size=1)
        try:
            async with engine.connect() as conn:
                result.append((await conn.execute(sa.text(statement))).scalar())
        finally:
            await engine.dispose()

    thread = threading.Thread(target=lambda: asyncio.run(read()))
    thread.start()
    thread.join(60)
    return result[0]


def _populate(url: str) -> None:
    if url.startswith("sqlite"):
        rows = ("WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < "
                f"{ROWS}) SELECT 's' || i AS id, i AS seq FROM n")
    else:
        rows = f"SELECT 's' || i AS id, i AS seq FROM generate_series(1, {ROWS}) i"
    _as_revision(url, lambda: Operations.execute(_op(), sa.text(
        "INSERT INTO sessions (id, tenant, envelope_tokens, surface_version, surface_tokens,"
        " surface_messages, last_seq, last_position, lease_fence, created_at)"
        f" SELECT id, 't', 0, 1, 0, 0, seq, 0, 0, CURRENT_TIMESTAMP FROM ({rows}) AS r")))


def _op() -> Operations:
    from alembic import op

    return op  # type: ignore[return-value]


def _relfilenode(url: str) -> object:
    if not url.startswith("postgresql"):
        return None
    return _query(url, "SELECT relfilenode FROM pg_class WHERE relname = 'sessions'")


def test_a_column_is_added_backfilled_and_indexed_online(url: str) -> None:
    postgres = url.startswith("postgresql")
    _populate(url)
    before = _relfilenode(url)

    # Refused: the kinds of column that rewrite the table (or fail on a populated one).
    for column in (sa.Column("probe_total", sa.BigInteger(),
                             sa.Computed("last_seq * 2", persisted=True)),
                   sa.Column("probe_required", sa.BigInteger(), nullable=False),
                   sa.Column("probe_at", sa.DateTime(), server_default=sa.text("now()"))):
        with pytest.raises(ValueError, match="rewrite"):
            _as_revision(url, lambda column=column: online.add_column("sessions", column))

    _as_revision(url, lambda: online.add_column(
        "sessions", sa.Column("probe", sa.BigInteger(), nullable=True)))
    _as_revision(url, lambda: online.add_column(
        "sessions", sa.Column("probe_flag", sa.Integer(), nullable=False,
                              server_default=sa.text("0"))))
    assert _relfilenode(url) == before

    # Each batch is committed before the next: another connection sees exactly what was done.
    seen: list[tuple[int, object]] = []

    def progress(done: int) -> None:
        # SQLite's batches share the revision's write transaction (one writer at a time).
        seen.append((done, _query(url, "SELECT count(*) FROM sessions WHERE probe IS NOT NULL")
                     if postgres else None))

    written: list[int] = []
    _as_revision(url, lambda: written.append(online.backfill(
        "sessions", "id", {"probe": "last_seq"}, "probe IS NULL", batch_rows=1000,
        progress=progress)))
    assert written == [ROWS]
    assert [done for done, _ in seen] == [1000, 2000, ROWS]
    if postgres:
        assert all(done == visible for done, visible in seen), seen
    assert _query(url, "SELECT count(*) FROM sessions WHERE probe = last_seq") == ROWS
    # A rerun finds nothing left.
    def rerun() -> None:
        written.append(online.backfill("sessions", "id", {"probe": "last_seq"}, "probe IS NULL"))

    _as_revision(url, rerun)
    assert written[-1] == 0

    sent = _as_revision(url, lambda: online.create_index(
        "ix_sessions_probe", "sessions", ["probe"], where="probe IS NOT NULL"))
    created = [s for s in sent if "ix_sessions_probe" in s]
    if postgres:
        assert any(s.strip().startswith("CREATE INDEX CONCURRENTLY") for s in created), created
        assert _query(url, "SELECT bool_and(i.indisvalid) FROM pg_index i JOIN pg_class c"
                           " ON c.oid = i.indexrelid WHERE c.relname = 'ix_sessions_probe'")
        assert _relfilenode(url) == before
    else:
        assert _query(url, "SELECT count(*) FROM sqlite_master"
                           " WHERE name = 'ix_sessions_probe'") == 1
    sent = _as_revision(url, lambda: online.drop_index("ix_sessions_probe", "sessions"))
    if postgres:
        assert any(s.strip().startswith("DROP INDEX CONCURRENTLY") for s in sent), sent

    # What add_column refuses does rewrite: a stored generated column, as revisions 0005,
    # 0012 and 0016 added, gives the table a new file.
    if postgres:
        _as_revision(url, lambda: _op().add_column("sessions", sa.Column(
            "probe_total", sa.BigInteger(), sa.Computed("last_seq * 2", persisted=True))))
        assert _relfilenode(url) != before

