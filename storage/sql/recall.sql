-- Recall: history_search and history_read over what compaction replaced (migration 0010).
-- A name ending in _pg or _sqlite is that backend's form of a statement the two spell
-- differently; the connector picks its own (Connector.variant), and both forms take the same
-- parameters, each naming those it uses.

-- name: history_session(session_id)
-- The session's tenant and run model (the read's token counter).
SELECT tenant, run_model FROM sessions WHERE id = :session_id;

-- name: history_node(session_id, ref)
-- The replace node a footer named (a pruned result pruned twice has two nodes of one name and
-- one original: the first serves).
SELECT seq, ref, first_seq, last_seq FROM recall_nodes
WHERE session_id = :session_id AND ref = :ref
ORDER BY seq LIMIT 1;

-- name: history_scanned(session_id, first_seq, last_seq)
-- What a search covers: the originals in the span, their count and bytes, summed over the
-- nodes inside it (each counts the originals it was the first to replace).
SELECT coalesce(sum(messages), 0) AS messages, coalesce(sum(bytes), 0) AS bytes
FROM recall_nodes
WHERE session_id = :session_id AND first_seq >= :first_seq AND last_seq <= :last_seq;

-- name: plan_for_each_search()
-- postgres-only: SQLite plans a statement each time it prepares it. A search's plan depends on
-- its values (a rare needle goes through the trigram index, a common word walks the session
-- backwards); a prepared statement's generic plan, which PostgreSQL switches to after five
-- runs on one connection, walks every original of the session for every needle. Planned for
-- each call to the end of the search's transaction (is_local).
SELECT set_config('plan_cache_mode', 'force_custom_plan', true);

-- name: history_search_exact_pg(session_id, first_seq, last_seq, query, pattern, before, width, limit)
-- postgres-only: the trigram GIN index answers ILIKE; SQLite has its trigram FTS5 table instead
-- (history_search_exact_sqlite).
-- Substring matches, case-insensitive, newest first: a rare needle is found through the
-- trigram index, a common one by walking the session's originals backwards until enough
-- match. The snippet is cut around the first match. The limit applies to the originals alone,
-- before the join: joined first, the planner expects a handful of rows from any pattern and
-- rechecks every message holding a common word through the index instead of walking.
SELECT c.seq, n.ref,
       substr(c.body, greatest(1, strpos(lower(c.body), lower(:query)) - :before), :width)
         AS snippet
FROM (SELECT o.seq, o.node_seq, o.body FROM recall_originals o
      WHERE o.session_id = :session_id AND o.seq BETWEEN :first_seq AND :last_seq
        AND o.body ILIKE :pattern
      ORDER BY o.seq DESC
      LIMIT :limit) c
JOIN recall_nodes n ON n.session_id = :session_id AND n.seq = c.node_seq
ORDER BY c.seq DESC;

-- name: history_search_exact_sqlite(session_id, first_seq, last_seq, query, phrase, needles, before, width, limit)
-- sqlite-only: recall_fts is an FTS5 table, which only SQLite has (PostgreSQL:
-- history_search_exact_pg).
-- Substring matches through the trigram FTS5 index (a phrase of trigrams is a substring,
-- case-insensitive), newest first; queries under three characters are matched by instr().
-- compactd_fold and compactd_snippet (storage.recall_text, registered on every connection)
-- fold case as PostgreSQL's lower() does, and cut past a NUL.
SELECT o.seq, n.ref, compactd_snippet(o.body, :needles, :before, :width) AS snippet
FROM recall_originals o
JOIN recall_nodes n ON n.session_id = o.session_id AND n.seq = o.node_seq
WHERE o.session_id = :session_id AND o.seq BETWEEN :first_seq AND :last_seq
  AND (CASE WHEN length(:query) >= 3
            THEN o.seq IN (SELECT seq FROM recall_fts
                           WHERE recall_fts MATCH :phrase AND session_id = :session_id)
            ELSE 1 END)
  AND instr(compactd_fold(o.body), compactd_fold(:query)) > 0
ORDER BY o.seq DESC
LIMIT :limit;

-- name: history_search_word_pg(session_id, first_seq, last_seq, pattern, cap)
-- postgres-only: the trigram GIN index answers ILIKE (SQLite: history_search_word_sqlite).
-- The ranked stage's candidates for one word: the newest cap originals holding it (a
-- case-insensitive substring). Asked word by word, each planned for its own pattern: a rare
-- word goes through the trigram index, a common one walks the session backwards.
SELECT o.seq FROM recall_originals o
WHERE o.session_id = :session_id AND o.seq BETWEEN :first_seq AND :last_seq
  AND o.body ILIKE :pattern
ORDER BY o.seq DESC
LIMIT :cap;

-- name: history_search_word_sqlite(session_id, first_seq, last_seq, word, phrase, cap)
-- sqlite-only: FTS5 MATCH is SQLite's (PostgreSQL: history_search_word_pg).
-- The ranked stage's candidates for one word (of three code points or more, folded): the newest
-- cap originals holding it, found through the trigram FTS5 index and checked with the folding
-- PostgreSQL's ILIKE applies.
SELECT o.seq FROM recall_originals o
WHERE o.session_id = :session_id AND o.seq BETWEEN :first_seq AND :last_seq
  AND o.seq IN (SELECT seq FROM recall_fts
                WHERE recall_fts MATCH :phrase AND session_id = :session_id)
  AND instr(compactd_fold(o.body), :word) > 0
ORDER BY o.seq DESC
LIMIT :cap;

-- name: history_search_held_pg(session_id, seq_list, word_list, query, before, width)
-- postgres-only: arrays and unnest are PostgreSQL's (SQLite: history_search_held_sqlite).
-- For each candidate that does not hold the whole query (an exact hit): which of the query's
-- folded words it holds (bit i for word i), and a snippet cut around the first of them.
-- storage.recall_text.rank orders them, the same on both backends.
SELECT c.seq, n.ref,
       (SELECT coalesce(sum(1 << (w.i - 1)::int), 0)::int
        FROM unnest(CAST(:word_list AS text[])) WITH ORDINALITY w(word, i)
        WHERE strpos(c.folded, w.word) > 0) AS held,
       substr(c.body, greatest(1, coalesce(
                (SELECT min(strpos(c.folded, w)) FROM unnest(CAST(:word_list AS text[])) w
                 WHERE strpos(c.folded, w) > 0), 1) - :before), :width) AS snippet
FROM (SELECT o.seq, o.node_seq, o.body, lower(o.body) AS folded FROM recall_originals o
      WHERE o.session_id = :session_id AND o.seq = ANY(CAST(:seq_list AS bigint[]))) c
JOIN recall_nodes n ON n.session_id = :session_id AND n.seq = c.node_seq
WHERE strpos(c.folded, lower(:query)) = 0;

-- name: history_search_held_sqlite(session_id, seqs, words, query, before, width)
-- sqlite-only: compactd_fold and compactd_snippet are functions compactd registers on its
-- SQLite connections (PostgreSQL: history_search_held_pg); the lists come as JSON arrays.
-- For each candidate that does not hold the whole query (an exact hit): which of the query's
-- folded words it holds (bit i for word i), and a snippet cut around the first of them.
WITH c AS MATERIALIZED (
  SELECT o.seq, o.node_seq, o.body, compactd_fold(o.body) AS folded FROM recall_originals o
  WHERE o.session_id = :session_id AND o.seq IN (SELECT value FROM json_each(:seqs)))
SELECT c.seq, n.ref,
       (SELECT coalesce(sum(1 << w.key), 0) FROM json_each(:words) w
        WHERE instr(c.folded, w.value) > 0) AS held,
       compactd_snippet(c.body, :words, :before, :width) AS snippet
FROM c
JOIN recall_nodes n ON n.session_id = :session_id AND n.seq = c.node_seq
WHERE instr(c.folded, compactd_fold(:query)) = 0;

-- name: history_search_pending_pg(session_id, first_seq, last_seq, escaped, pattern, before, width, scan, limit)
-- postgres-only: strpos and ILIKE are PostgreSQL's (SQLite: history_search_pending_sqlite).
-- Originals whose text is not indexed yet (the commit that replaced them has, the indexer after
-- it not yet): the newest :scan of them are scanned for the query in their payloads as
-- appended, newest first. The payload is JSON text, so the query is given JSON-escaped
-- (:escaped; :pattern is its LIKE pattern) and the snippet is cut from the JSON text; no JSON
-- operator reads it, as none could read a payload holding a NUL.
SELECT c.seq, n.ref,
       substr(c.raw, greatest(1, strpos(lower(c.raw), lower(:escaped)) - :before), :width)
         AS snippet
FROM (SELECT o.seq, o.node_seq, CAST(e.payload AS text) AS raw
      FROM (SELECT seq, node_seq FROM recall_originals
            WHERE session_id = :session_id AND body IS NULL
              AND seq BETWEEN :first_seq AND :last_seq
            ORDER BY seq DESC
            LIMIT :scan) o
      JOIN events e ON e.session_id = :session_id AND e.seq = o.seq) c
JOIN recall_nodes n ON n.session_id = :session_id AND n.seq = c.node_seq
WHERE c.raw ILIKE :pattern
ORDER BY c.seq DESC
LIMIT :limit;

-- name: history_search_pending_sqlite(session_id, first_seq, last_seq, escaped, before, width, scan, limit)
-- sqlite-only: compactd_fold is registered on compactd's SQLite connections (PostgreSQL: history_search_pending_pg).
-- The same scan of the originals not indexed yet, in their payloads as appended, folded as the
-- index is.
SELECT c.seq, n.ref,
       substr(c.raw, max(1, instr(compactd_fold(c.raw), compactd_fold(:escaped)) - :before),
              :width) AS snippet
FROM (SELECT o.seq, o.node_seq, CAST(e.payload AS TEXT) AS raw
      FROM (SELECT seq, node_seq FROM recall_originals
            WHERE session_id = :session_id AND body IS NULL
              AND seq BETWEEN :first_seq AND :last_seq
            ORDER BY seq DESC
            LIMIT :scan) o
      JOIN events e ON e.session_id = :session_id AND e.seq = o.seq) c
JOIN recall_nodes n ON n.session_id = :session_id AND n.seq = c.node_seq
WHERE instr(compactd_fold(c.raw), compactd_fold(:escaped)) > 0
ORDER BY c.seq DESC
LIMIT :limit;

-- name: history_count(session_id, first_seq, last_seq)
-- How many originals a node stands for.
SELECT count(*) FROM recall_originals
WHERE session_id = :session_id AND seq BETWEEN :first_seq AND :last_seq;

-- name: history_originals(session_id, first_seq, last_seq, limit, offset)
-- A page of a node's originals, as appended (byte-exact payloads), from the offset-th.
SELECT e.seq, e.payload
FROM recall_originals o
JOIN events e ON e.session_id = o.session_id AND e.seq = o.seq
WHERE o.session_id = :session_id AND o.seq BETWEEN :first_seq AND :last_seq
ORDER BY o.seq
LIMIT :limit OFFSET :offset;


-- Recording (migration 0014): each replace node is recorded in the transaction of the commit
-- that writes it, without reading a payload: the node, and its originals as pending rows
-- (body NULL). PostgreSQL's compactd_commit calls compactd_recall_index; SQLite's commit path
-- fires the recall trigger, which runs recall_index_originals and recall_index_node with the
-- event row's columns for parameters. The originals' text is indexed after the commit
-- (storage/recall_index.py: recall_pending_originals, recall_set_body, recall_node_bytes).

-- name: recall_replace_events()
-- Every replace event, in the order the commits recorded them (migration 0010's backfill).
SELECT session_id, seq, kind, payload FROM events
WHERE kind IN ('checkpoint', 'pruned')
ORDER BY session_id, seq;

-- name: recall_index(session_id, seq, kind, ref, first, last, replaces)$
-- postgres-only: calls compactd_recall_index (functions/compactd_recall_index.sql), the
-- function revision 0010's backfill creates and runs (the code's commit calls its later
-- version itself); SQLite runs recall_index_originals and recall_index_node.
SELECT compactd_recall_index(:session_id, :seq, :kind, :ref, :first, :last,
                             CAST(:replaces AS bigint[]));

-- name: recall_index_originals(session_id, seq, payload)!
-- sqlite-only: the SQLite trigger's first step (json_each is SQLite's; PostgreSQL does this in
-- compactd_recall_index). The originals this replace is the first to replace, pending: the
-- originals' own payloads are not read.
INSERT OR IGNORE INTO recall_originals (session_id, seq, node_seq, body, bytes)
SELECT e.session_id, e.seq, :seq, NULL, 0
FROM json_each(:payload, '$.replaces') r
JOIN events e ON e.session_id = :session_id AND e.seq = r.value AND e.kind = 'message';

-- name: recall_index_node(session_id, seq, kind, payload)!
-- sqlite-only: the SQLite trigger's second step (PostgreSQL: compactd_recall_index). The node,
-- named by its footer's ref (from its span for a node written before footers), with the span
-- its meta.recall states (first, last), else the union of the spans it replaced, and the
-- originals it was the first to replace (their bytes are counted as they are indexed).
INSERT OR IGNORE INTO recall_nodes (session_id, seq, ref, first_seq, last_seq, messages, bytes)
SELECT :session_id, :seq,
       coalesce(json_extract(:payload, '$.message.meta.recall.ref'),
                CASE WHEN :kind = 'pruned' THEN 'r' || coalesce(m.first, u.first)
                     ELSE 'c' || coalesce(m.first, u.first) || '-'
                          || coalesce(m.last, u.last) END),
       coalesce(m.first, u.first), coalesce(m.last, u.last), u.messages, 0
FROM (SELECT min(coalesce(n.first_seq, r.value)) AS first,
             max(coalesce(n.last_seq, r.value)) AS last,
             count(o.seq) AS messages
      FROM json_each(:payload, '$.replaces') r
      LEFT JOIN recall_nodes n ON n.session_id = :session_id AND n.seq = r.value
      LEFT JOIN recall_originals o ON o.session_id = :session_id AND o.seq = r.value
                                  AND o.node_seq = :seq) u,
     (SELECT CASE WHEN json_type(:payload, '$.message.meta.recall.first') = 'integer'
                   AND json_type(:payload, '$.message.meta.recall.last') = 'integer'
                  THEN json_extract(:payload, '$.message.meta.recall.first') END AS first,
             CASE WHEN json_type(:payload, '$.message.meta.recall.first') = 'integer'
                   AND json_type(:payload, '$.message.meta.recall.last') = 'integer'
                  THEN json_extract(:payload, '$.message.meta.recall.last') END AS last) m
WHERE coalesce(m.first, u.first) IS NOT NULL;

-- name: recall_pending_sessions(limit)
-- Sessions with originals not yet indexed (the partial index ix_recall_originals_pending).
SELECT DISTINCT session_id FROM recall_originals WHERE body IS NULL LIMIT :limit;

-- name: recall_pending_originals(session_id, limit)
-- A session's originals not yet indexed, oldest first, with their payloads as appended.
SELECT o.seq, o.node_seq, e.payload
FROM recall_originals o
JOIN events e ON e.session_id = o.session_id AND e.seq = o.seq
WHERE o.session_id = :session_id AND o.body IS NULL
ORDER BY o.seq
LIMIT :limit;

-- name: recall_set_bodies(session_id, seqs, bodies, sizes)!
-- postgres-only: arrays and a data-modifying WITH are PostgreSQL's; SQLite runs recall_set_body
-- once per original and recall_node_bytes once per node, in one transaction.
-- Originals' indexed texts and the sizes of their whole texts, and each node's bytes grown by
-- those of its originals indexed here, in one autocommit statement; an original indexed
-- already (by another indexer meanwhile) keeps what it has and adds nothing.
WITH done AS (
  UPDATE recall_originals o SET body = v.body, bytes = v.size
  FROM unnest(CAST(:seqs AS bigint[]), CAST(:bodies AS text[]), CAST(:sizes AS int[]))
       AS v(seq, body, size)
  WHERE o.session_id = :session_id AND o.seq = v.seq AND o.body IS NULL
  RETURNING o.node_seq, o.bytes)
UPDATE recall_nodes n SET bytes = n.bytes + d.bytes
FROM (SELECT node_seq, sum(bytes) AS bytes FROM done GROUP BY node_seq) d
WHERE n.session_id = :session_id AND n.seq = d.node_seq;

-- name: recall_set_body(session_id, seq, body, bytes)!
-- sqlite-only: PostgreSQL writes a batch in one statement (recall_set_bodies).
-- An original's indexed text and the size of its whole text; an original indexed already (by
-- another indexer meanwhile) keeps what it has.
UPDATE recall_originals SET body = :body, bytes = :bytes
WHERE session_id = :session_id AND seq = :seq AND body IS NULL;

-- name: recall_node_bytes(session_id, seq)!
-- sqlite-only: PostgreSQL adds the bytes in recall_set_bodies.
-- A node's bytes: those of its originals indexed so far.
UPDATE recall_nodes
SET bytes = (SELECT coalesce(sum(o.bytes), 0) FROM recall_originals o
             WHERE o.session_id = recall_nodes.session_id
               AND o.seq BETWEEN recall_nodes.first_seq AND recall_nodes.last_seq
               AND o.node_seq = recall_nodes.seq)
WHERE session_id = :session_id AND seq = :seq;

-- name: recall_fts_add(session_id, seq, body)!
-- sqlite-only: keeps the FTS5 table (SQLite's) in step with recall_originals, run by its
-- trigger when an original's text is indexed; PostgreSQL's GIN indexes keep themselves.
INSERT INTO recall_fts (session_id, seq, body) VALUES (:session_id, :seq, :body);

-- name: recall_fts_drop(session_id, seq)!
-- sqlite-only: keeps the FTS5 table (SQLite's) in step with recall_originals, run by its
-- delete trigger; PostgreSQL's GIN indexes keep themselves.
DELETE FROM recall_fts WHERE session_id = :session_id AND seq = :seq;

