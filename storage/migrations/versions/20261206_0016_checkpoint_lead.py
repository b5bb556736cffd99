"""checkpoint lead: fire a growing session early by its growth x the measured time to a checkpoint

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-06

A checkpoint lands some time after the signal that asked for it; a session firing at its
trigger spends that time over it. ``checkpoint_leads`` holds, per summary pool (the sessions of
one run model, ``*`` for all), the lead that pool's sessions fire by: a high percentile of
recent pressure-to-checkpoint times (``compaction_runs.signalled_at`` to ``finished_at``), or
the configured one (``summarization.lead``). The append copies its pool's lead onto the session row
(``sessions.lead_s``) with a primary-key read, so the hot path never reads runs, and the sweep's
flag counts the growth the lead stands for: ``over_sweep`` is re-created with it (a stored
generated column cannot change its expression in place), and with it its partial index.
The commits that replace part of the surface record what they left (``sessions.compacted_tokens``):
a session fires early by at most what it grew since, so a checkpoint that leaves it near its
trigger does not fire it again at once. Sessions from before this revision have a lead of 0
until their next append.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from compactd.storage import sql
from compactd.storage.schema import UTCDateTime

revision: str = "0016"
down_revision: str | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# As storage.schema.OVER_SWEEP_SQL has it at this revision.
OVER = (
    "sweep_tokens <= surface_tokens + envelope_tokens + growth_rate * lead_s * 5"
    " OR sweep_tokens <= reported_input_tokens + reported_output_tokens"
    " + growth_rate * lead_s * 5"
    " OR sweep_tokens <= reported_input_tokens + reported_output_tokens + surface_tokens"
    " + envelope_tokens - reported_base_tokens + growth_rate * lead_s * 5"
    " OR sweep_messages <= surface_messages")
# As revision 0005 created it.
OVER_0005 = (
    "sweep_tokens <= surface_tokens + envelope_tokens"
    " OR sweep_tokens <= reported_input_tokens + reported_output_tokens"
    " OR sweep_tokens <= reported_input_tokens + reported_output_tokens + surface_tokens"
    " + envelope_tokens - reported_base_tokens"
    " OR sweep_messages <= surface_messages")


def _over_sweep(expression: str) -> None:
    postgres = op.get_bind().dialect.name == "postgresql"
    op.drop_index("ix_sessions_over_trigger", table_name="sessions")
    # Plain DROP/ADD COLUMN on both backends (SQLite 3.35 and later drops in place; batch mode
    # would copy the table, which it cannot do with a generated column). SQLite can add only a
    # virtual generated column, as revision 0005 did.
    op.drop_column("sessions", "over_sweep")
    op.add_column("sessions", sa.Column("over_sweep", sa.Boolean(),
                                        sa.Computed(expression,
                                                    persisted=True if postgres else None)))
    op.create_index("ix_sessions_over_trigger", "sessions", ["id"],
                    postgresql_where=sa.text("over_sweep = true"),
                    sqlite_where=sa.text("over_sweep = 1"))


def upgrade() -> None:
    op.create_table(
        "checkpoint_leads",
        sa.Column("pool", sa.String(length=255), nullable=False),
        sa.Column("lead_s", sa.Float(), nullable=False),
        sa.Column("source", sa.String(length=16), nullable=False),
        sa.Column("runs", sa.Integer(), nullable=False),
        sa.Column("p90_s", sa.Float(), nullable=True),
        sa.Column("measured_at", UTCDateTime(), nullable=False),
        sa.PrimaryKeyConstraint("pool", name=op.f("pk_checkpoint_leads")),
    )
    op.add_column("sessions", sa.Column("lead_s", sa.Float(), nullable=False,
                                        server_default=sa.text("0")))
    op.add_column("sessions", sa.Column("compacted_tokens", sa.BigInteger(), nullable=True))
    op.add_column("compaction_runs", sa.Column("signalled_at", UTCDateTime(), nullable=True))
    _over_sweep(OVER)
    if op.get_bind().dialect.name == "postgresql":
        op.execute(sql.function_definition("compactd_append"))
        op.execute(sql.function_definition("compactd_commit"))


def downgrade() -> None:
    """The flag and its index as revision 0005 made them, and the append and commit functions
    as revision 0015's release ran them (they read and write the columns dropped here)."""
    _over_sweep(OVER_0005)
    if op.get_bind().dialect.name == "postgresql":
        op.execute(sql.function_definition("compactd_append", "0015"))
        op.execute(sql.function_definition("compactd_commit", "0015"))
    op.drop_column("compaction_runs", "signalled_at")
    op.drop_column("sessions", "compacted_tokens")
    op.drop_column("sessions", "lead_s")
    op.drop_table("checkpoint_leads")
