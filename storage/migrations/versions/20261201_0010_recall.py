"""recall: what compaction replaced, indexed for history_search and history_read

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-01

Two tables (``storage.schema.recall_nodes``, ``recall_originals``), filled as each replace
commits. The append path is untouched: only what a checkpoint or a prune takes off the surface
is recorded.

* ``recall_nodes``: each replace node's name (its ``meta.recall.ref`` as its footer gives it;
  computed from its span for a node written before footers) and the span of original seqs it
  stands for: the union of the spans of the nodes it replaced.
* ``recall_originals``: each message a replace took off the surface, once (by the node that
  first replaced it), with its searchable text: content (a string, or its text blocks), then
  each tool call's name and arguments.

Text indexes: on PostgreSQL ``pg_trgm`` GIN (substring ``ILIKE``) and a ``simple`` full-text
GIN (fuzzy); on SQLite an FTS5 table with the trigram tokenizer, kept by triggers. Existing
replace events are recorded in seq order as the commits record them now (revision 0014: the
node and its originals, pending; ``storage.recall_index`` indexes their text afterwards), by
the same function (``storage/sql/functions/``) on PostgreSQL and the same trigger steps
(``storage/sql/recall.sql``) on SQLite, as storage/sql has them now: revisions 0011 and 0014
changed them for databases migrated before them, and a new database gets the changed text here.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from compactd.storage import sql
from compactd.storage.recall_index import node_recall, sqlite_recall_triggers

REVISION = "0010"
revision: str = REVISION
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# PostgreSQL records a node in compactd_commit (revision 0014), which calls this function.
_FUNCTIONS = ("compactd_recall_index",)

_SQLITE_FTS = """
CREATE VIRTUAL TABLE recall_fts USING fts5(
  session_id UNINDEXED, seq UNINDEXED, body, tokenize = 'trigram')
"""
# What the SQLite trigger runs for one replace event (the backfill runs it too).
_SQLITE_STEPS = ("recall_index_originals", "recall_index_node")


def _tables() -> None:
    op.create_table(
        "recall_nodes",
        sa.Column("session_id", sa.String(255), nullable=False),
        sa.Column("seq", sa.BigInteger, nullable=False),
        sa.Column("ref", sa.String(64), nullable=False),
        sa.Column("first_seq", sa.BigInteger, nullable=False),
        sa.Column("last_seq", sa.BigInteger, nullable=False),
        sa.Column("messages", sa.Integer, nullable=False),
        sa.Column("bytes", sa.BigInteger, nullable=False),
        sa.ForeignKeyConstraint(["session_id"], ["sessions.id"], ondelete="CASCADE",
                                name="fk_recall_nodes_session_id_sessions"),
        sa.PrimaryKeyConstraint("session_id", "seq", name="pk_recall_nodes"),
    )
    op.create_index("ix_recall_nodes_ref", "recall_nodes", ["session_id", "ref"])
    op.create_table(
        "recall_originals",
        sa.Column("session_id", sa.String(255), nullable=False),
        sa.Column("seq", sa.BigInteger, nullable=False),
        sa.Column("node_seq", sa.BigInteger, nullable=False),
        sa.Column("body", sa.Text, nullable=True),
        sa.Column("bytes", sa.Integer, nullable=False),
        sa.ForeignKeyConstraint(["session_id"], ["sessions.id"], ondelete="CASCADE",
                                name="fk_recall_originals_session_id_sessions"),
        sa.PrimaryKeyConstraint("session_id", "seq", name="pk_recall_originals"),
    )


def upgrade() -> None:
    _tables()
    bind = op.get_bind()
    if bind.dialect.name == "postgresql":
        op.execute("CREATE EXTENSION IF NOT EXISTS pg_trgm")
        # A small pending list: inserting a commit's originals straight into the GIN trees made
        # every commit update thousands of posting lists under the session's row lock, and the
        # commits of all sessions queued behind one another; a pending list takes the batch in
        # one append, and a small one keeps what a search scans linearly short (the README's
        # throughput and recall results give both sides).
        op.execute("CREATE INDEX ix_recall_originals_trgm ON recall_originals USING gin"
                   " (body gin_trgm_ops) WITH (fastupdate = on, gin_pending_list_limit = 256)")
        op.execute("CREATE INDEX ix_recall_originals_tsv ON recall_originals USING gin"
                   " (to_tsvector('simple', body))"
                   " WITH (fastupdate = on, gin_pending_list_limit = 256)")
        for name in _FUNCTIONS:
            op.execute(sql.function_definition(name))
    else:
        op.execute(_SQLITE_FTS)
        for statement in sqlite_recall_triggers():
            op.execute(statement)
    record = sa.text(sql.NAMED_TEXT["recall_index"])
    steps = [sa.text(sql.NAMED_TEXT[name]) for name in _SQLITE_STEPS]
    for event in bind.execute(sa.text(sql.NAMED_TEXT["recall_replace_events"])).mappings().all():
        payload = event["payload"]
        text = payload if isinstance(payload, str) else json.dumps(payload)
        if bind.dialect.name == "postgresql":
            node = json.loads(text)
            stated = node_recall(node.get("message") or {})
            bind.execute(record, {**event, "ref": stated.ref, "first": stated.first,
                                  "last": stated.last,
                                  "replaces": [int(q) for q in node.get("replaces") or ()]})
        else:
            for step in steps:
                bind.execute(step, {**event, "payload": text})


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP FUNCTION IF EXISTS compactd_recall_index(text, bigint, text, text,"
                   " bigint, bigint, bigint[])")
    else:
        for name in ("compactd_recall", "compactd_recall_fts", "compactd_recall_fts_delete"):
            op.execute(f"DROP TRIGGER IF EXISTS {name}")
        op.execute("DROP TABLE IF EXISTS recall_fts")
    op.drop_table("recall_originals")
    op.drop_index("ix_recall_nodes_ref", table_name="recall_nodes")
    op.drop_table("recall_nodes")
