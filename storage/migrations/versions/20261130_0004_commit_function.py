"""commit function: a compaction's replacements in one round trip on PostgreSQL

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-30

A compaction commits twice when it prunes before it summarizes: the prunes, then the
checkpoint. As separate statements each commit costs eight or nine round trips through
SQLAlchemy (begin, lock, prefix read, events, delete, nodes, session update, run update,
commit), and the worker pays that CPU on every run. This function does everything but the run
row's end in one call; a commit that ends the run calls it in the same statement that ends the
run row (``LeasesMixin.commit``). The SQLite path does the same work in Python, and the
integration tests run every commit behaviour against both databases.

Arguments: the replacements flattened into arrays (``p_seqs`` holds every replaced seq,
``p_counts[i]`` how many of them replacement i names); ``p_expected_pos``/``p_expected_seq``
the surface prefix the plan read (NULL: no prefix check); ``p_end`` the ``compaction/end``
payload, written last with the lease cleared (NULL: the lease stays).

Errors, raised before anything is written: CD404 no such session; CD409 the fence or run moved
(DETAIL: the current fence); CD410 the surface changed (DETAIL ``prefix``, or ``order:i`` /
``contiguous:i`` for the 1-based replacement i whose seqs are no longer one contiguous run in
that order).
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

from storage.sql import function_definition

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# The definition is read from storage/sql, where it has not changed since this revision. Before
# a change to functions/compactd_commit.sql, paste the text this revision created here, and
# create the new one in the revision that changes it (as 0009 does for compactd_claim).
COMMIT_FUNCTION = function_definition("compactd_commit")


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(COMMIT_FUNCTION)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP FUNCTION IF EXISTS compactd_commit(text, text, bigint, timestamptz, "
                   "bigint[], int[], text[], json[], int[], text[], json[], bigint[], bigint[], "
                   "json)")
