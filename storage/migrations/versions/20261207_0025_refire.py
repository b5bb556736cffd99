"""refire: a session no run could bring under its trigger fires again after measured growth

Revision ID: 0025
Revises: 0024
Create Date: 2026-12-07

A trigger below what a compaction can reach (a long observation among the kept messages, an
envelope beside the keep over the trigger) leaves the session over its trigger after a run, and
every append would fire another run that changes nothing. Such a run records the pressure
below which the session does not fire again (``sessions.refire_tokens``) and the last
replacing commit it saw (``sessions.refire_version``, ``compacted_version`` then): any commit
that replaces part of the surface since makes the mark stale, so no statement that commits has
to clear it. Both columns are new and nullable: the release at 0024 neither reads nor writes
them, and fires as it did.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0025"
down_revision: str | None = "0024"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_COLUMNS = ("refire_tokens", "refire_version")


def upgrade() -> None:
    for column in _COLUMNS:
        op.add_column("sessions", sa.Column(column, sa.BigInteger(), nullable=True))


def downgrade() -> None:
    # SQLite (3.35 and later) drops a column in place.
    for column in reversed(_COLUMNS):
        op.drop_column("sessions", column)
