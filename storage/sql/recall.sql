-- Recall: history_search and history_read over what compaction replaced (migration 0010).
-- Placeholders are :name (SQLAlchemy text()). A name ending in _pg or _sqlite is that
-- backend's form of a statement the two spell differently.

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

-- name: history_search_exact_pg(session_id, first_seq, last_seq, query, pattern, before, width, limit)
-- Substring matches, case-insensitive, newest first: a rare needle is found through the
-- trigram index, a common one by walking the session's originals backwards until enough
-- match. The snippet is cut around the first match.
SELECT o.seq, n.ref,
       substr(o.body, greatest(1, strpos(lower(o.body), lower(:query)) - :before), :width)
         AS snippet
FROM recall_originals o
JOIN recall_nodes n ON n.session_id = o.session_id AND n.seq = o.node_seq
WHERE o.session_id = :session_id AND o.seq BETWEEN :first_seq AND :last_seq
  AND o.body ILIKE :pattern
ORDER BY o.seq DESC
LIMIT :limit;

-- name: history_search_fuzzy_pg(session_id, first_seq, last_seq, words, pattern, candidates, word_list, limit)
-- Messages sharing words with the query but not holding it whole: the newest candidates the
-- full-text index finds, ordered by how many of the query's words each holds (ranking every
-- match of a common word would read them all, and ts_rank would parse each body again).
SELECT c.seq, n.ref, c.body
FROM (SELECT o.seq, o.node_seq, o.body FROM recall_originals o
      WHERE o.session_id = :session_id AND o.seq BETWEEN :first_seq AND :last_seq
        AND to_tsvector('simple', o.body) @@ to_tsquery('simple', :words)
        AND NOT o.body ILIKE :pattern
      ORDER BY o.seq DESC
      LIMIT :candidates) c
JOIN recall_nodes n ON n.session_id = :session_id AND n.seq = c.node_seq
ORDER BY (SELECT count(*) FROM unnest(CAST(:word_list AS text[])) w
          WHERE strpos(lower(c.body), w) > 0) DESC, c.seq DESC
LIMIT :limit;

-- name: history_search_exact_sqlite(session_id, first_seq, last_seq, query, phrase, before, width, limit)
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

-- name: history_search_fuzzy_sqlite(session_id, first_seq, last_seq, query, words, limit)
-- Messages sharing words (three characters or more) with the query, by bm25.
SELECT o.seq, n.ref, o.body
FROM (SELECT seq, bm25(recall_fts) AS score FROM recall_fts
      WHERE recall_fts MATCH :words AND session_id = :session_id) f
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
