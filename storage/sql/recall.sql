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
-- json_extract ends a text at a NUL, so each NUL escape (\u0000, not an escaped backslash
-- before "u0000": those are set aside first, as U+FFFF) is read as a space (migration 0014).
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
    JOIN (SELECT session_id, seq, kind,
                 replace(replace(replace(payload, '\\', char(65535)), '\u0000', ' '),
                         char(65535), '\\') AS payload
          FROM events) e
      ON e.session_id = :session_id AND e.seq = r.value AND e.kind = 'message'));

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

