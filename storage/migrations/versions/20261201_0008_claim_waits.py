"""claim waits: a claim queues briefly for the session row instead of failing at once

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-01

A claim locked the session row with NOWAIT, so an append or a usage report holding the row for a
moment ended the claim ``busy`` (after a short retry that, under a steady stream of appends,
met the lock again nearly every time), and a session over its trigger was left without a run
until the next sweep or an overflow. The row is now locked with a lock wait of
``CLAIM_LOCK_WAIT`` (``storage.leases.CLAIM_LOCK_WAIT_S`` for the general path): the claim takes
its place in the row's lock queue behind the short transaction and goes on when it ends.
``busy`` is left for what it says, a live lease of another run. The run's deadline still ends
the wait sooner when less is left (the caller cancels the statement then).

The function keeps 0003's signature, so a worker of the revision before keeps working during a
rolling upgrade. Errors as in 0003; 55P03 now means the row stayed locked for the whole wait.

The text of ``compactd_claim`` is ``storage/sql/functions/compactd_claim.sql``, created by revision 0009
(see there); this revision keeps its reasons and writes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Nothing: revision 0009 creates compactd_claim."""


def downgrade() -> None:
    """Nothing: revision 0009's downgrade drops compactd_claim."""
