"""recall: the originals' full-text vector and its index dropped (PostgreSQL)

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-06

Word search no longer asks the full-text index: each query word is found as a case-insensitive
substring through the trigram index, and the words a candidate holds are ranked the same way on
both backends (``storage.recall_text``). The stored vector and its GIN index were still built
for every original the indexer wrote, on the database's cores, for nothing: dropping them is
the indexing work throughput pays for recall. SQLite is unchanged (its FTS5 trigram table is
what its word search reads).
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0015"
down_revision: str | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# As revision 0012 created the index.
_GIN = "WITH (fastupdate = on, gin_pending_list_limit = 256)"


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute("DROP INDEX IF EXISTS ix_recall_originals_tsv")
    op.execute("ALTER TABLE recall_originals DROP COLUMN IF EXISTS body_tsv")


def downgrade() -> None:
    """Revision 0014's search never read the vector; the column and index come back as 0012
    made them, so a database downgraded further is as those revisions left it."""
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute("ALTER TABLE recall_originals ADD COLUMN body_tsv tsvector"
               " GENERATED ALWAYS AS (to_tsvector('simple', body)) STORED")
    op.execute(f"CREATE INDEX ix_recall_originals_tsv ON recall_originals USING gin (body_tsv)"
               f" {_GIN}")
