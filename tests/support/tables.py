"""Row counts of the store's tables, for tests that prove a refused request wrote nothing."""

from __future__ import annotations

import sqlalchemy as sa

from storage import schema as t
from storage.database import snapshot
from storage.store import Store


async def row_counts(store: Store) -> dict[str, int]:
    """Rows per table, read in one snapshot."""
    out = {}
    async with snapshot(store.engine) as conn:
        for table in (t.sessions, t.events, t.surface, t.tool_calls, t.compaction_runs,
                      t.recall_nodes, t.recall_originals):
            out[table.name] = int((await conn.execute(
                sa.select(sa.func.count()).select_from(table))).scalar() or 0)
    return out
