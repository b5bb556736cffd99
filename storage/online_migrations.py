"""Schema changes that keep compactd running, for the revisions from 0019 on.

A revision runs while the previous release's workers and clients still read and write the same
tables (ops/RUNBOOK.md, "Upgrades"), so none may hold a table lock for longer than a catalog
write:

* :func:`add_column`: a column added nullable, or with a constant default, is a catalog change
  on both backends; a ``NOT NULL`` column without a default, a volatile default or a stored
  generated column (revisions 0005, 0012 and 0016 added one) rewrites the table under its
  exclusive lock, and is refused here.
* :func:`backfill`: the column's values written in batches of :data:`BATCH_ROWS` rows, each
  committed on its own, so an append waits for one batch's row locks at most; resumable (the
  batches take rows the condition still selects, and a rerun takes what is left).
* :func:`create_index` / :func:`drop_index`: ``CONCURRENTLY`` on PostgreSQL, outside the
  revision's transaction (Alembic's autocommit block), so writes go on while it builds; an
  index an interrupted build left invalid is dropped and built again.

SQLite (the embedded default, one process) has no concurrent writers to keep: the same calls
run there as plain statements in the revision's transaction. Each backend's way is in
:mod:`storage.connectors_migrations`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import sqlalchemy as sa
from alembic import op

from compactd.storage.connectors_migrations import online_changes

# Rows per backfill transaction: each batch's row locks are held only while it writes.
BATCH_ROWS = 2000


def add_column(table: str, column: sa.Column[object]) -> None:
    """Add ``column`` without rewriting ``table``; a column that would rewrite it is refused
    (add it nullable, backfill it, and make it required in a later release's revision)."""
    default = column.server_default
    if column.computed is not None and column.computed.persisted:
        raise ValueError(f"{table}.{column.name}: a stored generated column rewrites the table;"
                         " add a plain column and backfill it")
    if not column.nullable and default is None:
        raise ValueError(f"{table}.{column.name}: NOT NULL without a default rewrites or fails"
                         " on a populated table; add it nullable and backfill it")
    if default is not None and not _constant(default):
        raise ValueError(f"{table}.{column.name}: a volatile default rewrites the table; use a"
                         " constant default and backfill")
    op.add_column(table, column)


def _constant(default: object) -> bool:
    arg = getattr(default, "arg", None)
    text = str(getattr(arg, "text", arg) if arg is not None else "").strip().lower()
    return text not in ("", "now()", "current_timestamp") and "(" not in text


def backfill(table: str, key: str, values: Mapping[str, str], where: str, *,
             batch_rows: int = BATCH_ROWS,
             progress: Callable[[int], None] | None = None) -> int:
    """Set each column of ``values`` to its SQL expression on the rows ``where`` selects,
    ``batch_rows`` rows (by ``key``, the primary key or a unique column) per committed
    transaction, until ``where`` selects none; ``where`` must stop selecting a row once it is
    written. ``progress`` is called with the rows written so far after each batch commits.
    Returns the rows written."""
    rows = sa.table(table, sa.column(key), *(sa.column(name) for name in values))
    batch = (sa.select(rows.c[key]).where(sa.text(where)).order_by(rows.c[key])
             .limit(batch_rows).scalar_subquery())
    statement = (sa.update(rows).where(rows.c[key].in_(batch))
                 .values({name: sa.literal_column(expression)
                          for name, expression in values.items()}))
    with online_changes().batches():
        return _batches(statement, batch_rows, progress)


def _batches(statement: sa.Update, batch_rows: int,
             progress: Callable[[int], None] | None) -> int:
    bind = op.get_bind()
    done = 0
    while True:
        written = bind.execute(statement).rowcount
        done += written
        if progress is not None and written:
            progress(done)
        if written < batch_rows:
            return done


def create_index(name: str, table: str, columns: Sequence[str | sa.TextClause], *,
                 where: str | None = None, unique: bool = False) -> None:
    """``CREATE INDEX CONCURRENTLY`` on PostgreSQL (outside the revision's transaction; an
    invalid index a failed build left is dropped first), a plain ``CREATE INDEX`` on SQLite."""
    online_changes().create_index(name, table, columns, where=where, unique=unique)


def drop_index(name: str, table: str) -> None:
    """``DROP INDEX CONCURRENTLY`` on PostgreSQL, a plain ``DROP INDEX`` on SQLite."""
    online_changes().drop_index(name, table)


def create_functions(names: Sequence[str]) -> None:
    """Create these versions of compactd's SQL functions on PostgreSQL (a new version beside the
    ones the previous releases call); nothing on SQLite, whose connector runs them in Python."""
    online_changes().create_functions(names)


def drop_functions(names: Sequence[str]) -> None:
    """Drop these versions of compactd's SQL functions on PostgreSQL, newest first."""
    online_changes().drop_functions(names)
