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
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path

from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# How long a targeted claim waits for the session row: far longer than the transactions that
# hold it (an append, a usage report, another claim, a commit), far shorter than a run.
CLAIM_LOCK_WAIT = "5s"

_SIGNATURE = "compactd_claim(text, text, text, text, timestamptz, timestamptz, text, boolean)"


def _claim_0003() -> str:
    """0003's function text, read from that revision (a migration's text never changes)."""
    path = Path(__file__).with_name("20261130_0003_claim_function.py")
    spec = importlib.util.spec_from_file_location("compactd_migration_0003", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    text: str = module.CLAIM_FUNCTION
    return text


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        nowait = _claim_0003()
        waits = nowait.replace("FOR UPDATE NOWAIT", "FOR UPDATE")
        assert waits.count("FOR UPDATE") == nowait.count("FOR UPDATE") and waits != nowait
        op.execute(waits)
        # The lock_timeout is the function's own: it holds while the call runs, and the
        # connection's own setting is back when it returns.
        op.execute(f"ALTER FUNCTION {_SIGNATURE} SET lock_timeout = '{CLAIM_LOCK_WAIT}'")


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(_claim_0003())
        op.execute(f"ALTER FUNCTION {_SIGNATURE} RESET lock_timeout")
