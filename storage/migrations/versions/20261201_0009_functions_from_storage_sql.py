"""functions from storage/sql: the current definitions in one place; the claim loses skip_locked

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-01

compactd's PL/pgSQL functions are defined in ``storage/sql/functions/`` (the text the database
runs, which tests/migration compares with ``pg_get_functiondef``); this revision creates each
from there. ``compactd_claim`` loses its ``p_skip_locked`` argument, which no caller ever set,
so 0008's eight-argument function is dropped: a worker of an earlier revision fails its fast
claim until it is upgraded (the error says to run ``compactd migrate``). The lock wait that 0008
set with ALTER FUNCTION is now part of the definition (``SET lock_timeout``).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path

from alembic import op

from storage.sql import function_definition

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# This revision's functions (storage.sql.FUNCTIONS grows with later revisions, which create
# their own).
_FUNCTIONS = ("compactd_append", "compactd_claim", "compactd_commit")
_CLAIM_0008 = "compactd_claim(text, text, text, text, timestamptz, timestamptz, text, boolean)"
_CLAIM_0009 = "compactd_claim(text, text, text, text, timestamptz, timestamptz, text)"


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(f"DROP FUNCTION IF EXISTS {_CLAIM_0008}")
        for name in _FUNCTIONS:
            op.execute(function_definition(name))


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(f"DROP FUNCTION IF EXISTS {_CLAIM_0009}")
        # 0008's claim, as 0008 creates it (from 0003's text); append and commit are unchanged.
        path = Path(__file__).with_name("20261201_0008_claim_waits.py")
        spec = importlib.util.spec_from_file_location("compactd_migration_0008", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        module.upgrade()
