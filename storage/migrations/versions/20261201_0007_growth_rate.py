"""growth rate: each session's recent token growth, kept by the append

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01

A session's runway (the time left before its run model's window at its current growth) needs its
growth rate. The append keeps it on the session row, in the statement that already updates the
row's totals, so the hot path stays one round trip on PostgreSQL: an exponentially weighted rate
over ``GROWTH_WINDOW_S`` (``storage.records``), ``rate' = (rate * W + added) / (W + dt)`` with
``dt`` the seconds since the previous append. Sessions from before this revision start at 0.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# The window's seconds, as ``storage.records.GROWTH_WINDOW_S`` was when this revision was written
# (a migration does not follow the code's constants).
WINDOW_S = 120

# The appended tokens, the same sum the function's UPDATE already takes.
_ADDED = "(SELECT coalesce(sum(t), 0) FROM unnest(p_tokens) t)"
_OLD_SET = "           last_append_at = p_now\n"
_NEW_SET = (
    "           last_append_at = p_now,\n"
    # Columns on the right of SET are the row before the update: the previous append's time.
    f"           growth_rate = (growth_rate * {WINDOW_S} + {_ADDED})\n"
    f"                         / ({WINDOW_S} + greatest(0, extract(epoch FROM\n"
    "                               p_now - coalesce(last_append_at, created_at))))\n")


def _append_function_0002() -> str:
    """The function as revision 0002 created it: this revision changes only its UPDATE."""
    path = Path(__file__).with_name("20261130_0002_append_function.py")
    spec = importlib.util.spec_from_file_location("compactd_migration_0002", path)
    assert spec is not None and spec.loader is not None
    module: ModuleType = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    text: str = module.APPEND_FUNCTION
    assert text.count(_OLD_SET) == 1, "revision 0002's append function is not the expected one"
    return text


def upgrade() -> None:
    # A plain ADD COLUMN on both backends: SQLite's batch mode would copy the table, which it
    # cannot do past revision 0005's generated column.
    op.add_column("sessions", sa.Column("growth_rate", sa.Float(), nullable=False,
                                        server_default=sa.text("0")))
    if op.get_bind().dialect.name == "postgresql":
        op.execute(_append_function_0002().replace(_OLD_SET, _NEW_SET))


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(_append_function_0002())
    # SQLite (3.35 and later) drops a column in place; batch mode would copy the table.
    op.drop_column("sessions", "growth_rate")
