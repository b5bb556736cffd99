"""recall: what compaction replaced, indexed for history_search and history_read

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-01

Two tables (``storage.schema.recall_nodes``, ``recall_originals``) filled by a trigger on the
insert of every replace event, in the same transaction as the commit that writes it. The append
path is untouched: only what a checkpoint or a prune takes off the surface is indexed.

* ``recall_nodes``: each replace node's name (its ``meta.recall.ref`` as its footer gives it;
  computed from its span for a node written before footers) and the span of original seqs it
  stands for: the union of the spans of the nodes it replaced.
* ``recall_originals``: each message a replace took off the surface, once (by the node that
  first replaced it), with its searchable text: content (a string, or its text blocks), then
  each tool call's name and arguments.

Text indexes: on PostgreSQL ``pg_trgm`` GIN (substring ``ILIKE``) and a ``simple`` full-text
GIN (fuzzy); on SQLite an FTS5 table with the trigram tokenizer, kept by triggers. Existing
replace events are indexed in seq order, as the trigger would have, by the same statements
(the PostgreSQL functions are in ``storage/sql/functions/``, SQLite's trigger steps in
``storage/sql/recall.sql``), as storage/sql has them now: revision 0011 changed
``compactd_recall_index`` and the SQLite trigger's ``recall_index_node`` step for databases
migrated before it, and a new database gets the changed text here (a node written before
0011 states the span the union gives, so the backfill indexes what it indexed before).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from storage import sql

REVISION = "0010"
revision: str = REVISION
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_FUNCTIONS = ("compactd_recall_body", "compactd_recall_index", "compactd_recall_trigger")

_PG_TRIGGER = """
CREATE TRIGGER compactd_recall AFTER INSERT ON events FOR EACH ROW
WHEN (NEW.kind IN ('checkpoint', 'pruned')) EXECUTE FUNCTION compactd_recall_trigger()
"""

_SQLITE_FTS = """
CREATE VIRTUAL TABLE recall_fts USING fts5(
  session_id UNINDEXED, seq UNINDEXED, body, tokenize = 'trigram')
"""
# SQLite has no functions: its triggers run the named statements of storage/sql/recall.sql,
# which the backfill below runs too.
_SQLITE_TRIGGERS = (
    f"""CREATE TRIGGER compactd_recall AFTER INSERT ON events
    WHEN NEW.kind IN ('checkpoint', 'pruned') BEGIN
    {sql.as_trigger_body("recall_index_originals")};
    {sql.as_trigger_body("recall_index_node")};
    END""",
    f"""CREATE TRIGGER compactd_recall_fts AFTER INSERT ON recall_originals BEGIN
    {sql.as_trigger_body("recall_fts_add")};
    END""",
    f"""CREATE TRIGGER compactd_recall_fts_delete AFTER DELETE ON recall_originals BEGIN
    {sql.as_trigger_body("recall_fts_drop", row="OLD")};
    END""",
)
# What the trigger runs for one replace event, per dialect.
_INDEX_STEPS = {"postgresql": ("recall_index",),
                "sqlite": ("recall_index_originals", "recall_index_node")}


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
        sa.Column("body", sa.Text, nullable=False),
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
        op.execute(_PG_TRIGGER)
    else:
        op.execute(_SQLITE_FTS)
        for statement in _SQLITE_TRIGGERS:
            op.execute(statement)
    steps = [sa.text(sql.NAMED_TEXT[name])
             for name in _INDEX_STEPS[bind.dialect.name]]
    for event in bind.execute(sa.text(sql.NAMED_TEXT["recall_replace_events"])).mappings().all():
        payload = event["payload"]
        params = {**event, "payload": payload if isinstance(payload, str) else json.dumps(payload)}
        for step in steps:
            bind.execute(step, params)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP TRIGGER IF EXISTS compactd_recall ON events")
        op.execute("DROP FUNCTION IF EXISTS compactd_recall_trigger()")
        op.execute("DROP FUNCTION IF EXISTS compactd_recall_index(text, bigint, text, json)")
        op.execute("DROP FUNCTION IF EXISTS compactd_recall_body(json)")
    else:
        for name in ("compactd_recall", "compactd_recall_fts", "compactd_recall_fts_delete"):
            op.execute(f"DROP TRIGGER IF EXISTS {name}")
        op.execute("DROP TABLE IF EXISTS recall_fts")
    op.drop_table("recall_originals")
    op.drop_index("ix_recall_nodes_ref", table_name="recall_nodes")
    op.drop_table("recall_nodes")
