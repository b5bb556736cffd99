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

-- name: history_search_fuzzy_pg(session_id, first_seq, last_seq, tsquery, pattern, candidates, word_list, limit)
-- postgres-only: to_tsquery and arrays are PostgreSQL's; SQLite ranks FTS5 matches by bm25
-- (history_search_fuzzy_sqlite).
-- Messages sharing words with the query but not holding it whole: the newest candidates the
-- full-text index finds, ordered by how many of the query's words each holds (ranking every
-- match of a common word would read them all, and ts_rank would parse each body again).
-- body_tsv is the stored vector (migration 0012): a walk of the session's originals reads it
-- instead of computing it row by row.
SELECT c.seq, n.ref, c.body
FROM (SELECT o.seq, o.node_seq, o.body FROM recall_originals o
      WHERE o.session_id = :session_id AND o.seq BETWEEN :first_seq AND :last_seq
        AND o.body_tsv @@ to_tsquery('simple', :tsquery)
        AND NOT o.body ILIKE :pattern
      ORDER BY o.seq DESC
      LIMIT :candidates) c
JOIN recall_nodes n ON n.session_id = :session_id AND n.seq = c.node_seq
ORDER BY (SELECT count(*) FROM unnest(CAST(:word_list AS text[])) w
          WHERE strpos(lower(c.body), w) > 0) DESC, c.seq DESC
LIMIT :limit;

-- name: history_search_exact_sqlite(session_id, first_seq, last_seq, query, phrase, before, width, limit)
-- sqlite-only: recall_fts is an FTS5 table, which only SQLite has (PostgreSQL:
-- history_search_exact_pg).
-- Substring matches through the trigram FTS5 index (a phrase of trigrams is a substring,
-- case-insensitive), newest first; queries under three characters are matched by instr().
SELECT o.seq, n.ref,
       substr(o.body, max(1, instr(lower(o.body), lower(:query)) - :before), :width)
         AS snippet
FROM recall_originals o
JOIN recall_nodes n ON n.session_id = o.session_id AND n.seq = o.node_seq
WHERE o.session_id = :session_id AND o.seq BETWEEN :first_seq AND :last_seq
  AND (CASE WHEN length(:query) >= 3
            THEN o.seq IN (SELECT seq FROM recall_fts
                           WHERE recall_fts MATCH :phrase AND session_id = :session_id)
            ELSE 1 END)
  AND instr(lower(o.body), lower(:query)) > 0
ORDER BY o.seq DESC
LIMIT :limit;

-- name: history_search_fuzzy_sqlite(session_id, first_seq, last_seq, query, fts_words, limit)
-- sqlite-only: FTS5 MATCH and bm25 are SQLite's (PostgreSQL: history_search_fuzzy_pg).
-- Messages sharing words (three characters or more) with the query, by bm25.
SELECT o.seq, n.ref, o.body
FROM (SELECT seq, bm25(recall_fts) AS score FROM recall_fts
      WHERE recall_fts MATCH :fts_words AND session_id = :session_id) f
JOIN recall_originals o ON o.session_id = :session_id AND o.seq = f.seq
JOIN recall_nodes n ON n.session_id = o.session_id AND n.seq = o.node_seq
WHERE o.seq BETWEEN :first_seq AND :last_seq
  AND instr(lower(o.body), lower(:query)) = 0
ORDER BY f.score, o.seq DESC
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


-- Indexing (migration 0010): each replace event is indexed as it is inserted, by a trigger
-- running these statements with the event row's columns for parameters; the migration's
-- backfill runs the same statements for the replace events already in the log, in seq order.

-- name: recall_replace_events()
-- Every replace event, in the order the trigger would have indexed them.
SELECT session_id, seq, kind, payload FROM events
WHERE kind IN ('checkpoint', 'pruned')
ORDER BY session_id, seq;

-- name: recall_index(session_id, seq, kind, payload)$
-- postgres-only: calls compactd_recall_index (functions/compactd_recall_index.sql), which the
-- PostgreSQL trigger calls too; SQLite runs recall_index_originals and recall_index_node.
SELECT compactd_recall_index(:session_id, :seq, :kind, CAST(:payload AS json));

-- name: recall_index_originals(session_id, seq, payload)!
-- sqlite-only: the SQLite trigger's first step (json_each is SQLite's; PostgreSQL does this in
-- compactd_recall_index). The originals this replace is the first to replace, with their text:
-- content (a string, or its text blocks), then each tool call's name and arguments.
INSERT OR IGNORE INTO recall_originals (session_id, seq, node_seq, body, bytes)
SELECT session_id, seq, node_seq, body, length(CAST(body AS BLOB)) FROM (
  SELECT session_id, seq, node_seq,
         coalesce(content || char(10) || calls, content, calls, '') AS body
  FROM (
    SELECT e.session_id AS session_id, e.seq AS seq, :seq AS node_seq,
           CASE json_type(e.payload, '$.content')
             WHEN 'text' THEN json_extract(e.payload, '$.content')
             WHEN 'array' THEN (SELECT group_concat(json_extract(b.value, '$.text'), char(10))
                                FROM json_each(e.payload, '$.content') b
                                WHERE json_extract(b.value, '$.type') = 'text')
           END AS content,
           (SELECT group_concat(json_extract(c.value, '$[1]') || ' '
                                || json_extract(c.value, '$[2]'), char(10))
            FROM json_each(e.payload, '$.tool_calls') c) AS calls
    FROM json_each(:payload, '$.replaces') r
    JOIN events e ON e.session_id = :session_id AND e.seq = r.value AND e.kind = 'message'));

-- name: recall_index_node(session_id, seq, kind, payload)!
-- sqlite-only: the SQLite trigger's second step (PostgreSQL: compactd_recall_index). The node,
-- named by its footer's ref (from its span for a node written before footers), with the span
-- its meta.recall states (first, last), else the union of the spans it replaced, and the
-- originals it was the first to replace.
INSERT OR IGNORE INTO recall_nodes (session_id, seq, ref, first_seq, last_seq, messages, bytes)
SELECT :session_id, :seq,
       coalesce(json_extract(:payload, '$.message.meta.recall.ref'),
                CASE WHEN :kind = 'pruned' THEN 'r' || coalesce(m.first, u.first)
                     ELSE 'c' || coalesce(m.first, u.first) || '-'
                          || coalesce(m.last, u.last) END),
       coalesce(m.first, u.first), coalesce(m.last, u.last), u.messages, u.bytes
FROM (SELECT min(coalesce(n.first_seq, r.value)) AS first,
             max(coalesce(n.last_seq, r.value)) AS last,
             count(o.seq) AS messages, coalesce(sum(o.bytes), 0) AS bytes
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

-- name: recall_fts_add(session_id, seq, body)!
-- sqlite-only: keeps the FTS5 table (SQLite's) in step with recall_originals, run by its
-- insert trigger; PostgreSQL's GIN indexes keep themselves.
INSERT INTO recall_fts (session_id, seq, body) VALUES (:session_id, :seq, :body);

-- name: recall_fts_drop(session_id, seq)!
-- sqlite-only: keeps the FTS5 table (SQLite's) in step with recall_originals, run by its
-- delete trigger; PostgreSQL's GIN indexes keep themselves.
DELETE FROM recall_fts WHERE session_id = :session_id AND seq = :seq;
