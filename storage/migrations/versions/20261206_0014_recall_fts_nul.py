"""recall: on SQLite, the text after a NUL in a replaced message is indexed

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-06

SQLite's ``json_extract`` ends a text at a NUL, so the recall trigger indexed a message holding
one only up to it, and nothing after it could be searched (the original is kept whole in the
log; only its searchable text was cut). The trigger's first step (``recall_index_originals`` in
storage/sql/recall.sql) now reads each NUL as a space; this revision creates the trigger again
for a database migrated before it (revision 0010 creates it as storage/sql has it now). A
message indexed before this revision keeps the text it was indexed with. PostgreSQL is unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

from storage import sql

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    if op.get_bind().dialect.name != "sqlite":
        return
    op.execute("DROP TRIGGER IF EXISTS compactd_recall")
    op.execute(f"""CREATE TRIGGER compactd_recall AFTER INSERT ON events
    WHEN NEW.kind IN ('checkpoint', 'pruned') BEGIN
    {sql.as_trigger_body("recall_index_originals")};
    {sql.as_trigger_body("recall_index_node")};
    END""")


def downgrade() -> None:
    """Nothing to undo: revision 0010 creates the trigger as storage/sql has it, this step
    included (no store runs below the head revision)."""
