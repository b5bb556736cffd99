"""claim function: one round trip to take a free lease on PostgreSQL

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30

Every compaction starts with a claim. As separate statements it costs six round trips (begin,
lock, start event, lease update, run row, commit), each through SQLAlchemy's statement layer,
and the worker pays that CPU once per run; as this function it costs one.

The function covers the common case only: a session with no lease at all. It locks the row
(NOWAIT, or SKIP LOCKED for sweeps), and when a lease is live or an expired one still has to be
closed, it changes nothing and returns the row as it is: the caller then takes the general path
(``LeasesMixin._claim_once``) in its own transaction, which records the busy attempt or closes
the expired lease. The SQLite path is always the general one; the integration tests run every
claim behaviour against both databases.

Errors: CD404 no such session (or, with SKIP LOCKED, a row another transaction holds, which the
general path reports the same way); 55P03 from NOWAIT when another transaction holds the row.
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

CLAIM_FUNCTION = r"""
CREATE OR REPLACE FUNCTION compactd_claim(
    p_session text,
    p_run_id text,
    p_owner text,
    p_trigger text,
    p_expires timestamptz,
    p_now timestamptz,
    p_task_id text,
    p_skip_locked boolean
) RETURNS SETOF sessions
LANGUAGE plpgsql AS $$
DECLARE
    s sessions%ROWTYPE;
    new_fence bigint;
    start_seq bigint;
BEGIN
    IF p_skip_locked THEN
        SELECT * INTO s FROM sessions WHERE id = p_session FOR UPDATE SKIP LOCKED;
    ELSE
        SELECT * INTO s FROM sessions WHERE id = p_session FOR UPDATE NOWAIT;
    END IF;
    IF NOT FOUND THEN
        RAISE EXCEPTION USING ERRCODE = 'CD404', MESSAGE = 'no such session', DETAIL = p_session;
    END IF;
    IF s.lease_run_id IS NOT NULL
       OR (s.lease_expires_at IS NOT NULL AND s.lease_expires_at > p_now) THEN
        -- Leased, or an expired lease to close first: the caller's general path decides.
        RETURN NEXT s;
        RETURN;
    END IF;
    new_fence := s.lease_fence + 1;
    start_seq := s.last_seq + 1;
    INSERT INTO events (session_id, seq, kind, payload, tokens, run_id, created_at)
    VALUES (p_session, start_seq, 'compaction/start',
            json_build_object('run_id', p_run_id, 'trigger', p_trigger, 'owner', p_owner,
                              'fence', new_fence, 'surface_version', s.surface_version),
            NULL, p_run_id, p_now);
    UPDATE sessions
       SET last_seq = start_seq, lease_owner = p_owner, lease_run_id = p_run_id,
           lease_expires_at = p_expires, lease_fence = new_fence
     WHERE id = p_session
    RETURNING * INTO s;
    INSERT INTO compaction_runs (id, session_id, trigger, status, owner, fence, task_id,
                                 surface_version_at_start, started_at, heartbeat_at)
    VALUES (p_run_id, p_session, p_trigger, 'running', p_owner, new_fence, p_task_id,
            s.surface_version, p_now, p_now);
    RETURN NEXT s;
END;
$$;
"""


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(CLAIM_FUNCTION)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP FUNCTION IF EXISTS compactd_claim(text, text, text, text, timestamptz, "
                   "timestamptz, text, boolean)")
