"""commit keeps: a checkpoint may leave the rescued nodes inside its range where they are

Revision ID: 0024
Revises: 0023
Create Date: 2026-12-06

Until this revision a replace named one contiguous run of the surface, so a summarized range
split by a rescued node (the latest user request, a reminder) was reduced one segment a run and
the agent carried the rest until a later one. ``compactd_commit_v4`` takes, per replacement,
the nodes inside its run that stay (``p_keeps``, ``p_keep_counts``): the replaced and kept nodes
together must be the contiguous run, and the new node goes after the last kept one
(``storage.surface``). Only a function is created; ``compactd_commit_v3`` stays for the release
at 0022, whose commits never keep nodes.
"""

from __future__ import annotations

from collections.abc import Sequence

from compactd.storage import online_migrations as online

revision: str = "0024"
down_revision: str | None = "0023"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_CREATED = ("compactd_commit_v4",)


def upgrade() -> None:
    online.create_functions(_CREATED)


def downgrade() -> None:
    online.drop_functions(_CREATED)
