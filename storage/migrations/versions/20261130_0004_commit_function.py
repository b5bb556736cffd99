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

The text of ``compactd_commit`` is ``storage/sql/functions/compactd_commit.sql``, created by revision 0009
(see there); this revision keeps its reasons and writes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Nothing: revision 0009 creates compactd_commit."""


def downgrade() -> None:
    """Nothing: revision 0009's downgrade drops compactd_commit."""
