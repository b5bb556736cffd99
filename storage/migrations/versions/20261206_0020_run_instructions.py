"""run instructions: what a manual run was asked to focus on

Revision ID: 0020
Revises: 0019
Create Date: 2026-12-06

A manual compaction may carry instructions (``compact --instructions``, an agent's
``compact_context``). The queued request keeps them until its run starts (a request coalesced
into it adds its own), and the run row records every one the run was given. Both columns are
new and nullable: the release at 0019 neither reads nor writes them, and its rows read as
runs without instructions.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0020"
down_revision: str | None = "0019"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_TABLES = ("manual_requests", "compaction_runs")


def upgrade() -> None:
    for table in _TABLES:
        op.add_column(table, sa.Column("instructions", sa.JSON(none_as_null=True),
                                       nullable=True))


def downgrade() -> None:
    # SQLite (3.35 and later) drops a column in place.
    for table in reversed(_TABLES):
        op.drop_column(table, "instructions")
