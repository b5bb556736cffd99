"""recall off the commit: a commit records what it replaced, the text is indexed after it

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-06

Until this revision every replace event was indexed by a trigger in the transaction of the
commit that wrote it, under the session's row lock: a NUL in a replaced tool result made the
commit fail on PostgreSQL (no JSON operator reads a ``\\u0000``), a megabyte of distinct tokens
went past the tsvector limit and rolled back every later commit, and the row stayed locked
while megabytes were indexed, so appends waited for it.

Now the commit records each replace node and its originals without reading a payload, the
originals as pending rows (``recall_originals.body`` NULL, so the column takes NULL), and
``storage.recall_index`` indexes their text afterwards in transactions of its own, bounded per
original. On PostgreSQL ``compactd_commit`` does the recording (three more arguments: the refs
and spans each node's ``meta.recall`` states, read by the caller) through the new
``compactd_recall_index``, and the events trigger, its function and ``compactd_recall_body``
are dropped; a worker of an earlier revision fails its commits until it is upgraded (the error
says to run ``compactd migrate``). On SQLite the events trigger stays (its JSON functions read
a NUL) and records pending rows; the FTS5 table takes an original's text when it is indexed.
A partial index finds the pending rows. Originals indexed before this revision keep their text.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from compactd.storage import sql
from compactd.storage.recall_index import sqlite_recall_triggers

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# The releases before this revision recorded recall in a trigger on events that kept every
# original's text, with functions of their own that no revision keeps: no release could run on
# the schema this downgrade would leave. Base (an empty schema) stays allowed.
DOWNGRADE_REFUSED = (
    "revision 0014 (recall off the commit) cannot be undone: the releases before it need "
    "recall's trigger and their own SQL functions, which are not kept. Downgrade no further "
    "than 0014, restore a backup taken before the upgrade past 0013, or downgrade to base (an "
    "empty schema).")

_COMMIT_0011 = ("compactd_commit(text, text, bigint, timestamptz, bigint[], int[], text[],"
                " json[], int[], text[], json[], bigint[], bigint[], json, bigint[], bigint[])")
_PENDING_INDEX = ("CREATE INDEX IF NOT EXISTS ix_recall_originals_pending ON recall_originals"
                  " (session_id, seq) WHERE body IS NULL")


def upgrade() -> None:
    bind = op.get_bind()
    if bind.dialect.name == "postgresql":
        op.execute("DROP TRIGGER IF EXISTS compactd_recall ON events")
        op.execute("DROP FUNCTION IF EXISTS compactd_recall_trigger()")
        op.execute("DROP FUNCTION IF EXISTS compactd_recall_index(text, bigint, text, json)")
        op.execute("DROP FUNCTION IF EXISTS compactd_recall_body(json)")
        op.execute(f"DROP FUNCTION IF EXISTS {_COMMIT_0011}")
        op.execute(sql.function_definition("compactd_recall_index"))
        op.execute(sql.function_definition("compactd_commit"))
        op.execute("ALTER TABLE recall_originals ALTER COLUMN body DROP NOT NULL")
    else:
        for name in ("compactd_recall", "compactd_recall_fts", "compactd_recall_fts_delete"):
            op.execute(f"DROP TRIGGER IF EXISTS {name}")
        columns = bind.execute(sa.text("PRAGMA table_info(recall_originals)")).mappings().all()
        if any(c["name"] == "body" and c["notnull"] for c in columns):
            with op.batch_alter_table("recall_originals", recreate="always") as batch:
                batch.alter_column("body", existing_type=sa.Text, nullable=True)
        for statement in sqlite_recall_triggers():
            op.execute(statement)
    op.execute(_PENDING_INDEX)


def downgrade() -> None:
    """Refused unless the schema goes to base (migrations/env.py checks before any step runs;
    this is for a caller that reaches the step anyway, such as offline SQL)."""
    from alembic import context
    from alembic.util import CommandError

    if context.get_revision_argument() is not None:
        raise CommandError(DOWNGRADE_REFUSED)
    op.execute("DROP INDEX IF EXISTS ix_recall_originals_pending")
