"""compacted version: which surface version the last replace produced

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-06

A usage report names the surface version its call was built on. Every append bumps the version,
so "the stored version moved past it" refused the report of every runtime that appended the
reply before reporting (as the README's flow does): the provider's counts were lost. What makes
a report stale is a compaction committed after its version, so the session row keeps the
version the last replacing commit produced (``compactd_commit`` on PostgreSQL, the store's
commit on SQLite), and the report compares with that.

Sessions compacted before this revision get their current version: a report built before now
is refused as the rule before this revision refused it, once, and the next is measured right.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from compactd.storage import sql

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("sessions", sa.Column("compacted_version", sa.BigInteger(), nullable=True))
    sessions = sa.table("sessions", sa.column("id"), sa.column("surface_version"),
                        sa.column("compacted_version"))
    events = sa.table("events", sa.column("session_id"), sa.column("kind"))
    replaced = sa.exists().where(events.c.session_id == sessions.c.id,
                                 events.c.kind.in_(("checkpoint", "pruned")))
    op.execute(sessions.update().where(replaced)
               .values(compacted_version=sessions.c.surface_version))
    if op.get_bind().dialect.name == "postgresql":
        op.execute(sql.function_definition("compactd_commit"))


def downgrade() -> None:
    # Nothing else to undo: revision 0009 creates compactd_commit as storage/sql has it (no
    # store runs below the head revision). SQLite (3.35 and later) drops a column in place.
    op.drop_column("sessions", "compacted_version")
