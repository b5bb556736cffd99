"""Row counts of the store's tables, for tests that prove a refused request wrote nothing."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from compactd.storage import schema as t
from compactd.storage.database import snapshot
from compactd.storage.store import Store


async def row_counts(store: Store) -> dict[str, int]:
    """Rows per table, read in one snapshot."""
    out = {}
    async with snapshot(store.engine) as conn:
        for table in (t.sessions, t.events, t.surface, t.tool_calls, t.compaction_runs,
                      t.recall_nodes, t.recall_originals):
            out[table.name] = int((await conn.execute(
                sa.select(sa.func.count()).select_from(table))).scalar() or 0)
    return out


async def session_tables(store: Store) -> dict[str, str]:
    """Every table of the live database with a column naming a session, and that column: the
    schema's tables (``storage.schema.metadata``) and what migrations create beside them
    (SQLite's FTS5 table), read from the database itself so a table added later is listed."""
    async with snapshot(store.engine) as conn:
        def tables(sync: Any) -> dict[str, str]:
            inspector = sa.inspect(sync)
            found = {}
            for name in inspector.get_table_names():
                columns = {c["name"] for c in inspector.get_columns(name)}
                if "session_id" in columns:
                    found[name] = "session_id"
                elif name == t.sessions.name:
                    found[name] = "id"
            return found
        return await conn.run_sync(tables)


async def session_row_counts(store: Store, session_id: str) -> dict[str, int]:
    """Rows of ``session_id`` in each table of :func:`session_tables`, in one snapshot."""
    named = await session_tables(store)
    out = {}
    async with snapshot(store.engine) as conn:
        for name, column in named.items():
            table = sa.table(name, sa.column(column))
            out[name] = int((await conn.execute(
                sa.select(sa.func.count()).select_from(table)
                .where(table.c[column] == session_id))).scalar() or 0)
    return out
