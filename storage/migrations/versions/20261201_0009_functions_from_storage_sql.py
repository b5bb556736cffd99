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

The earlier revisions (0002, 0003, 0004, 0007, 0008) no longer carry function text: each
function is written once in the tree, and a new database gets all three here, as storage/sql
has them now. Downgrading below this revision drops them (no store runs below the head
revision). A later revision that changes one of these files creates the new text for databases
migrated before the change; this one creates the new text too. So revision 0014's nineteen-
argument ``compactd_commit`` is created here on a new database, and dropped below here with the
fourteen- and sixteen-argument ones this revision created before 0011 and 0014.
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

from compactd.storage.sql import function_definition

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# This revision's functions (storage.sql.FUNCTIONS grows with later revisions, which create
# their own).
_FUNCTIONS = ("compactd_append", "compactd_claim", "compactd_commit")
_CLAIM_0008 = "compactd_claim(text, text, text, text, timestamptz, timestamptz, text, boolean)"
_SIGNATURES = (
    "compactd_append(text, json[], int[], timestamptz, text[], int[], int[], text[], int[])",
    "compactd_claim(text, text, text, text, timestamptz, timestamptz, text)",
    "compactd_commit(text, text, bigint, timestamptz, bigint[], int[], text[], json[], int[],"
    " text[], json[], bigint[], bigint[], json)",
    "compactd_commit(text, text, bigint, timestamptz, bigint[], int[], text[], json[], int[],"
    " text[], json[], bigint[], bigint[], json, bigint[], bigint[])",
    "compactd_commit(text, text, bigint, timestamptz, bigint[], int[], text[], json[], int[],"
    " text[], json[], bigint[], bigint[], json, bigint[], bigint[], text[], bigint[], bigint[])",
)


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(f"DROP FUNCTION IF EXISTS {_CLAIM_0008}")
        for name in _FUNCTIONS:
            op.execute(function_definition(name))


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        for signature in _SIGNATURES:
            op.execute(f"DROP FUNCTION IF EXISTS {signature}")
