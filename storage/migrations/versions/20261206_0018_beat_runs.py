"""beat runs: when retention's purge last ran, and what it removed

Revision ID: 0018
Revises: 0015
Create Date: 2026-12-06

`compactd status` runs in a process of its own, so the purge records its last run in the
database, one row per beat task.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import compactd.storage.schema

revision: str = "0018"
down_revision: str | None = "0017"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "beat_runs",
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("finished_at", compactd.storage.schema.UTCDateTime(timezone=True), nullable=False),
        sa.Column("result", sa.JSON(none_as_null=True), nullable=True),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_beat_runs")),
    )


def downgrade() -> None:
    op.drop_table("beat_runs")
