"""versioned functions: the functions the code calls carry their version in their name

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-06

Revisions 0009 and 0011 replaced compactd_claim and compactd_commit under the same name with
another signature: a worker of the release before, still running during a rolling upgrade,
found its function gone and failed every claim. From this revision on, the code calls
``compactd_<name>_v<N>``; a revision that changes a function creates the next version beside
the current one, and the version a previous release calls is dropped only by a revision of a
later release (ops/RUNBOOK.md, "Upgrades"). This revision is the expand step: it creates the
second generation (the first one's text, renamed) and keeps the unversioned first generation
the releases up to revision 0018 call. No table is touched, so it takes no lock that a worker's
statements wait on for longer than the catalog writes.
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

from compactd.storage.sql import function_definition, function_signature

revision: str = "0019"
down_revision: str | None = "0018"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# compactd_commit_v2 calls compactd_recall_index_v2: created first, dropped last.
_CREATED = ("compactd_recall_index_v2", "compactd_append_v2", "compactd_claim_v2",
            "compactd_commit_v2")


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    for name in _CREATED:
        op.execute(function_definition(name))


def downgrade() -> None:
    """The second generation goes; the first, which revision 0018's release calls, stayed."""
    if op.get_bind().dialect.name != "postgresql":
        return
    for name in reversed(_CREATED):
        op.execute(f"DROP FUNCTION IF EXISTS {function_signature(name)}")
