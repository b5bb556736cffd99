"""recall: the originals' full-text vector stored beside their text (PostgreSQL)

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-02

history_search's fuzzy stage wants the newest originals of one session that share a word with
the query. Once many sessions share the table, PostgreSQL prefers walking that session's
originals backwards by primary key over the full-text index, and with an expression index the
walk computes ``to_tsvector`` for every row it passes (thousands for a common word): the search
p99 at 10^4 messages went past its goal. A stored generated column makes the walk read the
vector instead of computing it, and the GIN index moves onto that column, so either plan is
cheap. The vector is computed once, when a commit indexes the original, as the expression index
computed it before. SQLite answers fuzzy searches from its FTS5 table and is unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# As revision 0010 created the index: a small pending list, so a commit's originals do not
# wait on the posting-list updates of the commits before them.
_GIN = "WITH (fastupdate = on, gin_pending_list_limit = 256)"


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute("ALTER TABLE recall_originals ADD COLUMN body_tsv tsvector"
               " GENERATED ALWAYS AS (to_tsvector('simple', body)) STORED")
    op.execute("DROP INDEX IF EXISTS ix_recall_originals_tsv")
    op.execute(f"CREATE INDEX ix_recall_originals_tsv ON recall_originals USING gin (body_tsv)"
               f" {_GIN}")


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute("DROP INDEX IF EXISTS ix_recall_originals_tsv")
    op.execute("ALTER TABLE recall_originals DROP COLUMN body_tsv")
    op.execute("CREATE INDEX ix_recall_originals_tsv ON recall_originals USING gin"
               f" (to_tsvector('simple', body)) {_GIN}")
