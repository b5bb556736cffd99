"""recall: the trigram index holds indexed originals only, with a larger pending list (PostgreSQL)

Revision ID: 0017
Revises: 0015
Create Date: 2026-12-06

Since revision 0014 a commit inserts the originals it replaced as pending rows (``body`` NULL),
and the trigram GIN index took an entry for each of them into its pending list. A commit whose
insert found the list over its limit then merged everyone's pending trigrams into the trees,
inside the commit, under the session's row lock. The index is now partial (``body IS NOT
NULL``): commits never touch it, only the indexer does; every search already asks ``body ILIKE``,
which implies it, so the planner keeps using it. Its pending list grows from 256 kB to 1 MB:
the merge costs less per entry the more entries it takes at once, and a search scans the list
linearly, which a few megabytes would slow (the README's throughput results give both).
SQLite is unchanged (its FTS5 table only ever takes indexed text).
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0017"
down_revision: str | None = "0016"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute("DROP INDEX IF EXISTS ix_recall_originals_trgm")
    op.execute("CREATE INDEX ix_recall_originals_trgm ON recall_originals USING gin"
               " (body gin_trgm_ops) WITH (fastupdate = on, gin_pending_list_limit = 1024)"
               " WHERE body IS NOT NULL")


def downgrade() -> None:
    """As revision 0010 created it."""
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute("DROP INDEX IF EXISTS ix_recall_originals_trgm")
    op.execute("CREATE INDEX ix_recall_originals_trgm ON recall_originals USING gin"
               " (body gin_trgm_ops) WITH (fastupdate = on, gin_pending_list_limit = 256)")
