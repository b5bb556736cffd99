"""sweep thresholds and the index of sessions over them; reported output tokens

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01

The pressure sweep used to lock every session row each interval and decide in Python. Each
session now carries the thresholds its trigger resolves to (written by the sweep, keyed by the
configuration they came from), and a partial index holds the sessions whose cached totals reach
them, so a sweep reads only those. The index is on a generated flag, not on the totals: an
append changes the totals but rarely the flag, so it stays a heap-only update on PostgreSQL.

A usage report now keeps the call's output tokens and the surface plus envelope tokens at the
time of the report: the next request holds the response and what was appended after it.
Reports taken before this revision count as input only, measured from now.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

OVER = (
    "sweep_tokens <= surface_tokens + envelope_tokens"
    " OR sweep_tokens <= reported_input_tokens + reported_output_tokens"
    " OR sweep_tokens <= reported_input_tokens + reported_output_tokens + surface_tokens"
    " + envelope_tokens - reported_base_tokens"
    " OR sweep_messages <= surface_messages")


def upgrade() -> None:
    with op.batch_alter_table("sessions") as batch:
        batch.add_column(sa.Column("reported_output_tokens", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("reported_base_tokens", sa.BigInteger(), nullable=True))
        batch.add_column(sa.Column("sweep_key", sa.String(length=32), nullable=True))
        batch.add_column(sa.Column("sweep_tokens", sa.BigInteger(), nullable=True))
        batch.add_column(sa.Column("sweep_messages", sa.Integer(), nullable=True))
    postgres = op.get_bind().dialect.name == "postgresql"
    with op.batch_alter_table("sessions") as batch:
        # PostgreSQL stores a generated column; SQLite can add only a virtual one to a table.
        batch.add_column(sa.Column("over_sweep", sa.Boolean(),
                                   sa.Computed(OVER, persisted=True if postgres else None)))
    sessions = sa.table("sessions", sa.column("reported_output_tokens"),
                        sa.column("reported_base_tokens"), sa.column("reported_input_tokens"),
                        sa.column("surface_tokens"), sa.column("envelope_tokens"))
    op.execute(sa.update(sessions)
               .where(sessions.c.reported_input_tokens.is_not(None))
               .values(reported_output_tokens=0,
                       reported_base_tokens=sessions.c.surface_tokens
                       + sessions.c.envelope_tokens))
    op.create_index("ix_sessions_sweep_key", "sessions", ["sweep_key"])
    op.create_index("ix_sessions_over_trigger", "sessions", ["id"],
                    postgresql_where=sa.text("over_sweep = true"),
                    sqlite_where=sa.text("over_sweep = 1"))


def downgrade() -> None:
    op.drop_index("ix_sessions_over_trigger", table_name="sessions")
    op.drop_index("ix_sessions_sweep_key", table_name="sessions")
    with op.batch_alter_table("sessions") as batch:
        for name in ("over_sweep", "sweep_messages", "sweep_tokens", "sweep_key",
                     "reported_base_tokens",
                     "reported_output_tokens"):
            batch.drop_column(name)
