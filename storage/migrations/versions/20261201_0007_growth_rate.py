"""growth rate: each session's recent token growth, kept by the append

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01

A session's runway (the time left before its run model's window at its current growth) needs its
growth rate. The append keeps it on the session row, in the statement that already updates the
row's totals, so the hot path stays one round trip on PostgreSQL: an exponentially weighted rate
over ``GROWTH_WINDOW_S`` (``storage.records``), ``rate' = (rate * W + added) / (W + dt)`` with
``dt`` the seconds since the previous append. Sessions from before this revision start at 0.
The append function that keeps it is created by revision 0009, from storage/sql.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # A plain ADD COLUMN on both backends: SQLite's batch mode would copy the table, which it
    # cannot do past revision 0005's generated column.
    op.add_column("sessions", sa.Column("growth_rate", sa.Float(), nullable=False,
                                        server_default=sa.text("0")))


def downgrade() -> None:
    # SQLite (3.35 and later) drops a column in place; batch mode would copy the table.
    op.drop_column("sessions", "growth_rate")
