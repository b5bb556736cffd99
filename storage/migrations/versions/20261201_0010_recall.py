"""recall: what compaction replaced, indexed for history_search and history_read

Revision ID: 0010
Revises: 0008 (the lead renumbers it after 0009 at merge)
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
replace events are indexed in seq order, as the trigger would have.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_PG_BODY = """
CREATE FUNCTION compactd_recall_body(payload json) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
SELECT concat_ws(E'\\n',
  CASE json_typeof(payload->'content')
    WHEN 'string' THEN payload->>'content'
    WHEN 'array' THEN (SELECT string_agg(b->>'text', E'\\n')
                       FROM json_array_elements(payload->'content') b
                       WHERE b->>'type' = 'text')
  END,
  (SELECT string_agg(concat_ws(' ', c->>1, c->>2), E'\\n')
   FROM json_array_elements(CASE json_typeof(payload->'tool_calls') WHEN 'array'
                            THEN payload->'tool_calls' ELSE '[]'::json END) c))
$$
"""

_PG_INDEX = """
CREATE FUNCTION compactd_recall_index(p_session text, p_seq bigint, p_kind text, p_payload json)
RETURNS void LANGUAGE plpgsql AS $$
DECLARE
  v_first bigint;
  v_last bigint;
  v_messages integer;
  v_bytes bigint;
BEGIN
  WITH added AS (
    INSERT INTO recall_originals (session_id, seq, node_seq, body, bytes)
    SELECT e.session_id, e.seq, p_seq, b.body, octet_length(b.body)
    FROM json_array_elements_text(p_payload->'replaces') r(value)
    JOIN events e ON e.session_id = p_session AND e.seq = r.value::bigint AND e.kind = 'message'
    CROSS JOIN LATERAL (SELECT coalesce(compactd_recall_body(e.payload), '') AS body) b
    ON CONFLICT DO NOTHING
    RETURNING bytes)
  SELECT count(*), coalesce(sum(bytes), 0) INTO v_messages, v_bytes FROM added;
  SELECT min(coalesce(n.first_seq, r.value::bigint)), max(coalesce(n.last_seq, r.value::bigint))
  INTO v_first, v_last
  FROM json_array_elements_text(p_payload->'replaces') r(value)
  LEFT JOIN recall_nodes n ON n.session_id = p_session AND n.seq = r.value::bigint;
  IF v_first IS NULL THEN
    RETURN;
  END IF;
  INSERT INTO recall_nodes (session_id, seq, ref, first_seq, last_seq, messages, bytes)
  VALUES (p_session, p_seq,
          coalesce(p_payload->'message'->'meta'->'recall'->>'ref',
                   CASE WHEN p_kind = 'pruned' THEN 'r' || v_first
                        ELSE 'c' || v_first || '-' || v_last END),
          v_first, v_last, v_messages, v_bytes)
  ON CONFLICT DO NOTHING;
END
$$
"""

_PG_TRIGGER_FUNCTION = """
CREATE FUNCTION compactd_recall_trigger() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  PERFORM compactd_recall_index(NEW.session_id, NEW.seq, NEW.kind, NEW.payload);
  RETURN NULL;
END
$$
"""

_PG_TRIGGER = """
CREATE TRIGGER compactd_recall AFTER INSERT ON events FOR EACH ROW
WHEN (NEW.kind IN ('checkpoint', 'pruned')) EXECUTE FUNCTION compactd_recall_trigger()
"""

_PG_BACKFILL = """
DO $$
DECLARE
  r record;
BEGIN
  FOR r IN SELECT session_id, seq, kind, payload FROM events
           WHERE kind IN ('checkpoint', 'pruned') ORDER BY session_id, seq LOOP
    PERFORM compactd_recall_index(r.session_id, r.seq, r.kind, r.payload);
  END LOOP;
END
$$
"""

# SQLite: one statement per step of the trigger body, shared with the backfill (which runs
# them per replace event, in seq order, with NEW bound to that event).
_SQLITE_BODY = """(
  CASE json_type(e.payload, '$.content')
    WHEN 'text' THEN json_extract(e.payload, '$.content')
    WHEN 'array' THEN (SELECT group_concat(json_extract(b.value, '$.text'), char(10))
                       FROM json_each(e.payload, '$.content') b
                       WHERE json_extract(b.value, '$.type') = 'text')
  END)"""
_SQLITE_CALLS = """(
  SELECT group_concat(json_extract(c.value, '$[1]') || ' ' || json_extract(c.value, '$[2]'),
                      char(10))
  FROM json_each(e.payload, '$.tool_calls') c)"""
_SQLITE_ORIGINALS = f"""
INSERT OR IGNORE INTO recall_originals (session_id, seq, node_seq, body, bytes)
SELECT session_id, seq, node_seq, body, length(CAST(body AS BLOB)) FROM (
  SELECT e.session_id AS session_id, e.seq AS seq, NEW.seq AS node_seq,
         CASE WHEN {_SQLITE_BODY} IS NULL THEN coalesce({_SQLITE_CALLS}, '')
              WHEN {_SQLITE_CALLS} IS NULL THEN {_SQLITE_BODY}
              ELSE {_SQLITE_BODY} || char(10) || {_SQLITE_CALLS} END AS body
  FROM json_each(NEW.payload, '$.replaces') r
  JOIN events e ON e.session_id = NEW.session_id AND e.seq = r.value AND e.kind = 'message')
"""
_SQLITE_NODE = """
INSERT OR IGNORE INTO recall_nodes (session_id, seq, ref, first_seq, last_seq, messages, bytes)
SELECT NEW.session_id, NEW.seq,
       coalesce(json_extract(NEW.payload, '$.message.meta.recall.ref'),
                CASE WHEN NEW.kind = 'pruned' THEN 'r' || min(coalesce(n.first_seq, r.value))
                     ELSE 'c' || min(coalesce(n.first_seq, r.value)) || '-'
                          || max(coalesce(n.last_seq, r.value)) END),
       min(coalesce(n.first_seq, r.value)), max(coalesce(n.last_seq, r.value)),
       count(o.seq), coalesce(sum(o.bytes), 0)
FROM json_each(NEW.payload, '$.replaces') r
LEFT JOIN recall_nodes n ON n.session_id = NEW.session_id AND n.seq = r.value
LEFT JOIN recall_originals o ON o.session_id = NEW.session_id AND o.seq = r.value
                            AND o.node_seq = NEW.seq
HAVING count(*) > 0
"""
_SQLITE_FTS = """
CREATE VIRTUAL TABLE recall_fts USING fts5(
  session_id UNINDEXED, seq UNINDEXED, body, tokenize = 'trigram')
"""
_SQLITE_TRIGGERS = (
    f"""CREATE TRIGGER compactd_recall AFTER INSERT ON events
    WHEN NEW.kind IN ('checkpoint', 'pruned') BEGIN
    {_SQLITE_ORIGINALS};
    {_SQLITE_NODE};
    END""",
    """CREATE TRIGGER compactd_recall_fts AFTER INSERT ON recall_originals BEGIN
    INSERT INTO recall_fts (session_id, seq, body) VALUES (NEW.session_id, NEW.seq, NEW.body);
    END""",
    """CREATE TRIGGER compactd_recall_fts_delete AFTER DELETE ON recall_originals BEGIN
    DELETE FROM recall_fts WHERE session_id = OLD.session_id AND seq = OLD.seq;
    END""",
)


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
    if op.get_bind().dialect.name == "postgresql":
        op.execute("CREATE EXTENSION IF NOT EXISTS pg_trgm")
        # fastupdate off: a GIN pending list is scanned linearly by every search until vacuum
        # merges it, and a commit's batch of originals is off the append path anyway.
        op.execute("CREATE INDEX ix_recall_originals_trgm ON recall_originals"
                   " USING gin (body gin_trgm_ops) WITH (fastupdate = off)")
        op.execute("CREATE INDEX ix_recall_originals_tsv ON recall_originals"
                   " USING gin (to_tsvector('simple', body)) WITH (fastupdate = off)")
        for statement in (_PG_BODY, _PG_INDEX, _PG_TRIGGER_FUNCTION, _PG_TRIGGER, _PG_BACKFILL):
            op.execute(statement)
        return
    op.execute(_SQLITE_FTS)
    for statement in _SQLITE_TRIGGERS:
        op.execute(statement)
    bind = op.get_bind()
    events = bind.execute(sa.text(
        "SELECT session_id, seq, kind, payload FROM events"
        " WHERE kind IN ('checkpoint', 'pruned') ORDER BY session_id, seq")).all()
    for session_id, seq, kind, payload in events:
        params = {"s": session_id, "q": seq, "k": kind, "p": payload}
        for statement in (_SQLITE_ORIGINALS, _SQLITE_NODE):
            bind.execute(sa.text(statement.replace("NEW.session_id", ":s")
                                 .replace("NEW.seq", ":q").replace("NEW.kind", ":k")
                                 .replace("NEW.payload", ":p")), params)


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
