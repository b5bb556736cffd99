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

The text of ``compactd_claim`` is ``storage/sql/functions/compactd_claim.sql``, created by revision 0009
(see there); this revision keeps its reasons and writes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Nothing: revision 0009 creates compactd_claim."""


def downgrade() -> None:
    """Nothing: revision 0009's downgrade drops compactd_claim."""
