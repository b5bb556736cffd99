"""append function: one round trip for the runtime's hot path on PostgreSQL

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30

An append is the one write on the agent's critical path. As separate statements it costs five
round trips (begin, update, two inserts, commit); as this function it costs one, which is what
keeps ``append`` plus ``poll`` near a millisecond. The SQLite path does the same work in Python;
the integration tests run every append behaviour against both.

Errors are raised with compactd's own SQLSTATEs so storage can name the message and field:
CD404 no such session; CD001 a tool-call id reused while its earlier call is open; CD002 a
tool result whose call was never made; CD003 a tool call that already has its result. DETAIL is
the call id, HINT the 0-based index of the message in the batch.

The text of ``compactd_append`` is ``storage/sql/functions/compactd_append.sql``, created by revision 0009
(see there); this revision keeps its reasons and writes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Nothing: revision 0009 creates compactd_append."""


def downgrade() -> None:
    """Nothing: revision 0009's downgrade drops compactd_append."""
