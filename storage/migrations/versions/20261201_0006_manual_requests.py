"""manual requests: at most one queued manual compaction per session

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01

Forty ``POST /compact`` for one session queued forty tasks on ``compaction.urgent``, the queue
every tenant's overflow runs share. A manual request now records its task here, and one made
while that task is queued and not started answers with the same task id.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import compactd.storage.schema

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "manual_requests",
        sa.Column("session_id", sa.String(length=255), nullable=False),
        sa.Column("task_id", sa.String(length=64), nullable=False),
        sa.Column("queued_at", compactd.storage.schema.UTCDateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["session_id"], ["sessions.id"],
                                name=op.f("fk_manual_requests_session_id_sessions"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("session_id", name=op.f("pk_manual_requests")),
    )


def downgrade() -> None:
    op.drop_table("manual_requests")
