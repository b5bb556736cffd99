"""initial schema

Revision ID: 0001
Revises:
Create Date: 2026-11-30 03:44:04.620748
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import compactd.storage.schema

revision: str = '0001'
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('bulk_jobs',
    sa.Column('id', sa.String(length=36), nullable=False),
    sa.Column('filter', sa.JSON(none_as_null=True), nullable=False),
    sa.Column('state', sa.String(length=32), nullable=False),
    sa.Column('force', sa.Boolean(), nullable=False),
    sa.Column('rate_per_s', sa.Float(), nullable=True),
    sa.Column('matched', sa.Integer(), nullable=False),
    sa.Column('created_at', compactd.storage.schema.UTCDateTime(timezone=True), nullable=False),
    sa.Column('updated_at', compactd.storage.schema.UTCDateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_bulk_jobs'))
    )
    op.create_table('sessions',
    sa.Column('id', sa.String(length=255), nullable=False),
    sa.Column('tenant', sa.String(length=255), nullable=False),
    sa.Column('run_model', sa.String(length=255), nullable=True),
    sa.Column('context_window', sa.Integer(), nullable=True),
    sa.Column('envelope', sa.JSON(none_as_null=True), nullable=True),
    sa.Column('envelope_tokens', sa.Integer(), nullable=False),
    sa.Column('policy', sa.JSON(none_as_null=True), nullable=True),
    sa.Column('surface_version', sa.BigInteger(), nullable=False),
    sa.Column('surface_tokens', sa.BigInteger(), nullable=False),
    sa.Column('surface_messages', sa.Integer(), nullable=False),
    sa.Column('last_seq', sa.BigInteger(), nullable=False),
    sa.Column('last_position', sa.BigInteger(), nullable=False),
    sa.Column('reported_input_tokens', sa.Integer(), nullable=True),
    sa.Column('reported_version', sa.BigInteger(), nullable=True),
    sa.Column('signal_at', compactd.storage.schema.UTCDateTime(timezone=True), nullable=True),
    sa.Column('lease_owner', sa.String(length=255), nullable=True),
    sa.Column('lease_run_id', sa.String(length=36), nullable=True),
    sa.Column('lease_expires_at', compactd.storage.schema.UTCDateTime(timezone=True), nullable=True),
    sa.Column('lease_fence', sa.BigInteger(), nullable=False),
    sa.Column('cooldown_until', compactd.storage.schema.UTCDateTime(timezone=True), nullable=True),
    sa.Column('flagged_reason', sa.Text(), nullable=True),
    sa.Column('flagged_at', compactd.storage.schema.UTCDateTime(timezone=True), nullable=True),
    sa.Column('created_at', compactd.storage.schema.UTCDateTime(timezone=True), nullable=False),
    sa.Column('last_append_at', compactd.storage.schema.UTCDateTime(timezone=True), nullable=True),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_sessions'))
    )
    op.create_index(op.f('ix_sessions_lease_expires_at'), 'sessions', ['lease_expires_at'], unique=False)
    op.create_index(op.f('ix_sessions_tenant'), 'sessions', ['tenant'], unique=False)
    op.create_table('bulk_items',
    sa.Column('job_id', sa.String(length=36), nullable=False),
    sa.Column('session_id', sa.String(length=255), nullable=False),
    sa.Column('state', sa.String(length=32), nullable=False),
    sa.Column('run_id', sa.String(length=36), nullable=True),
    sa.Column('updated_at', compactd.storage.schema.UTCDateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['job_id'], ['bulk_jobs.id'], name=op.f('fk_bulk_items_job_id_bulk_jobs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('job_id', 'session_id', name=op.f('pk_bulk_items'))
    )
    op.create_index(op.f('ix_bulk_items_job_id'), 'bulk_items', ['job_id', 'state'], unique=False)
    op.create_table('compaction_runs',
    sa.Column('id', sa.String(length=36), nullable=False),
    sa.Column('session_id', sa.String(length=255), nullable=False),
    sa.Column('trigger', sa.String(length=32), nullable=False),
    sa.Column('status', sa.String(length=32), nullable=False),
    sa.Column('failure_class', sa.String(length=32), nullable=True),
    sa.Column('owner', sa.String(length=255), nullable=True),
    sa.Column('fence', sa.BigInteger(), nullable=True),
    sa.Column('task_id', sa.String(length=255), nullable=True),
    sa.Column('bulk_job_id', sa.String(length=36), nullable=True),
    sa.Column('surface_version_at_start', sa.BigInteger(), nullable=True),
    sa.Column('range_seqs', sa.JSON(none_as_null=True), nullable=True),
    sa.Column('candidates', sa.JSON(none_as_null=True), nullable=True),
    sa.Column('stages', sa.JSON(none_as_null=True), nullable=True),
    sa.Column('model', sa.String(length=255), nullable=True),
    sa.Column('usage', sa.JSON(none_as_null=True), nullable=True),
    sa.Column('tokens_before', sa.Integer(), nullable=True),
    sa.Column('tokens_after', sa.Integer(), nullable=True),
    sa.Column('error', sa.Text(), nullable=True),
    sa.Column('started_at', compactd.storage.schema.UTCDateTime(timezone=True), nullable=False),
    sa.Column('heartbeat_at', compactd.storage.schema.UTCDateTime(timezone=True), nullable=True),
    sa.Column('finished_at', compactd.storage.schema.UTCDateTime(timezone=True), nullable=True),
    sa.ForeignKeyConstraint(['session_id'], ['sessions.id'], name=op.f('fk_compaction_runs_session_id_sessions'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_compaction_runs'))
    )
    op.create_index(op.f('ix_compaction_runs_bulk_job_id'), 'compaction_runs', ['bulk_job_id'], unique=False)
    op.create_index(op.f('ix_compaction_runs_session_id'), 'compaction_runs', ['session_id', 'started_at'], unique=False)
    op.create_index(op.f('ix_compaction_runs_status'), 'compaction_runs', ['status', 'started_at'], unique=False)
    op.create_index(op.f('ix_compaction_runs_task_id'), 'compaction_runs', ['task_id'], unique=False)
    op.create_table('events',
    sa.Column('session_id', sa.String(length=255), nullable=False),
    sa.Column('seq', sa.BigInteger(), nullable=False),
    sa.Column('kind', sa.String(length=32), nullable=False),
    sa.Column('payload', sa.JSON(none_as_null=True), nullable=False),
    sa.Column('tokens', sa.Integer(), nullable=True),
    sa.Column('run_id', sa.String(length=36), nullable=True),
    sa.Column('created_at', compactd.storage.schema.UTCDateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['session_id'], ['sessions.id'], name=op.f('fk_events_session_id_sessions'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('session_id', 'seq', name=op.f('pk_events'))
    )
    op.create_table('surface',
    sa.Column('session_id', sa.String(length=255), nullable=False),
    sa.Column('position', sa.BigInteger(), nullable=False),
    sa.Column('seq', sa.BigInteger(), nullable=False),
    sa.Column('tokens', sa.Integer(), nullable=False),
    sa.ForeignKeyConstraint(['session_id'], ['sessions.id'], name=op.f('fk_surface_session_id_sessions'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('session_id', 'position', name=op.f('pk_surface')),
    sa.UniqueConstraint('session_id', 'seq', name=op.f('uq_surface_session_id'))
    )
    op.create_table('tool_calls',
    sa.Column('session_id', sa.String(length=255), nullable=False),
    sa.Column('call_id', sa.String(length=255), nullable=False),
    sa.Column('call_seq', sa.BigInteger(), nullable=False),
    sa.Column('result_seq', sa.BigInteger(), nullable=True),
    sa.ForeignKeyConstraint(['session_id'], ['sessions.id'], name=op.f('fk_tool_calls_session_id_sessions'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('session_id', 'call_id', 'call_seq', name=op.f('pk_tool_calls'))
    )


def downgrade() -> None:
    op.drop_table('tool_calls')
    op.drop_table('surface')
    op.drop_table('events')
    op.drop_index(op.f('ix_compaction_runs_task_id'), table_name='compaction_runs')
    op.drop_index(op.f('ix_compaction_runs_status'), table_name='compaction_runs')
    op.drop_index(op.f('ix_compaction_runs_session_id'), table_name='compaction_runs')
    op.drop_index(op.f('ix_compaction_runs_bulk_job_id'), table_name='compaction_runs')
    op.drop_table('compaction_runs')
    op.drop_index(op.f('ix_bulk_items_job_id'), table_name='bulk_items')
    op.drop_table('bulk_items')
    op.drop_index(op.f('ix_sessions_tenant'), table_name='sessions')
    op.drop_index(op.f('ix_sessions_lease_expires_at'), table_name='sessions')
    op.drop_table('sessions')
    op.drop_table('bulk_jobs')
