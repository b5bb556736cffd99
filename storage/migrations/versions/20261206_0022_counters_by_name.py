"""counters by name: a counter a trigger kind needs is kept without a column or function of its own

Revision ID: 0022
Revises: 0021
Create Date: 2026-12-06

Until this revision each counter a trigger kind measures (tokens, messages) had its columns
(``surface_<counter>``, ``sweep_<counter>``), its increment in the append on both backends and
its term in the generated ``over_sweep``: a new counter was a migration and SQL on two
backends. From here a counter other than those two is kept by name (``storage.counters``): each
surface row holds what its node adds (``surface.counts``), the session row the sums
(``sessions.counts``), the sweep's floors (``sessions.sweep_counts``) and whether some sum
reaches its floor (``sessions.over_counts``, with a partial index as ``over_sweep`` has). The
append and the commit take the counts as JSON and sum them by name (``compactd_append_v3``,
``compactd_commit_v3``, over ``compactd_counts_sum_v1`` and ``compactd_counts_reach_v1``); the
second generation stays for the releases at 0020 and 0021. Every column is new and nullable or of a
constant default, the index is built concurrently: those releases go on appending and
committing (it leaves the new columns as they are; no counter is kept by name before this
release).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from compactd.storage import online_migrations as online
from compactd.storage.sql import function_definition, function_signature

revision: str = "0022"
down_revision: str | None = "0021"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# The helpers first: the append and the commit call them.
_CREATED = ("compactd_counts_sum_v1", "compactd_counts_reach_v1", "compactd_append_v3",
            "compactd_commit_v3")
_INDEX = "ix_sessions_over_counts"


def upgrade() -> None:
    online.add_column("sessions", sa.Column("counts", sa.JSON(none_as_null=True),
                                            nullable=True))
    online.add_column("sessions", sa.Column("sweep_counts", sa.JSON(none_as_null=True),
                                            nullable=True))
    online.add_column("sessions", sa.Column("over_counts", sa.Boolean, nullable=False,
                                            server_default=sa.false()))
    online.add_column("surface", sa.Column("counts", sa.JSON(none_as_null=True),
                                           nullable=True))
    postgres = op.get_bind().dialect.name == "postgresql"
    if postgres:
        for name in _CREATED:
            op.execute(function_definition(name))
    # As storage.schema's index compiles on each backend, so the sweep's query matches it.
    online.create_index(_INDEX, "sessions", ["id"],
                        where="over_counts = true" if postgres else "over_counts = 1")


def downgrade() -> None:
    online.drop_index(_INDEX, "sessions")
    if op.get_bind().dialect.name == "postgresql":
        for name in reversed(_CREATED):
            op.execute(f"DROP FUNCTION IF EXISTS {function_signature(name)}")
    # SQLite (3.35 and later) drops a column in place.
    op.drop_column("surface", "counts")
    for column in ("over_counts", "sweep_counts", "counts"):
        op.drop_column("sessions", column)
