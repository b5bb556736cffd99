"""step lead: each append keeps the session's largest recent step, which the lead counts

Revision ID: 0026
Revises: 0025
Create Date: 2026-12-07

A session whose single steps are large next to its trigger (a long tool result) crosses it in
one step, long before its growth rate over the lead says it will. ``sessions.step_tokens``
keeps its largest recent step (``records.step_tokens_after``), which ``worker.pressure`` counts
beside the growth. Expand only: a column with a constant default (a catalog change: the release
at 0025 neither reads nor writes it, and its ``compactd_append_v4`` leaves it as it is) and
``compactd_append_v5``, the append that keeps it, beside v4. The sweep's stored flag is
unchanged: it counts the growth, and catches at its trigger a session whose step would have
fired it earlier and whose signal was lost.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from compactd.storage import online_migrations as online

revision: str = "0026"
down_revision: str | None = "0025"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_CREATED = ("compactd_append_v5",)


def upgrade() -> None:
    online.add_column("sessions", sa.Column("step_tokens", sa.Float(), nullable=False,
                                            server_default=sa.text("0")))
    online.create_functions(_CREATED)


def downgrade() -> None:
    online.drop_functions(_CREATED)
    # SQLite (3.35 and later) drops a column in place.
    op.drop_column("sessions", "step_tokens")
