-- compactd's named statements, loaded once by storage.sql (aiosql). Parameters are :name; the
-- PostgreSQL connector runs them through asyncpg ($1...), the SQLite connector through
-- SQLAlchemy with the same names. A query that only PostgreSQL can run says why in a
-- "postgres-only:" line; tests/integration/test_sql_contract.py runs every other one on both.

-- name: ping()$
-- The health check's round trip.
SELECT 1;

-- name: invalid_index(index_name)$
-- postgres-only: an index a failed CREATE INDEX CONCURRENTLY left invalid
-- (storage.online_migrations drops it before building it again).
SELECT 1 FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
WHERE c.relname = :index_name AND NOT i.indisvalid;

-- name: schema_revision()$
-- The schema's Alembic revision: the embedded database is migrated when it is behind.
SELECT version_num FROM alembic_version;

-- name: read_surface(session_id)
-- The surface in position order with the version it was read at: the worker's read of every
-- compaction. A session without nodes gives one row whose node columns are NULL.
SELECT s.surface_version, f.position, f.seq, f.tokens, e.kind, e.payload
  FROM sessions s
  LEFT JOIN surface f ON f.session_id = s.id
  LEFT JOIN events e ON e.session_id = f.session_id AND e.seq = f.seq
 WHERE s.id = :session_id
 ORDER BY f.position;

-- name: recent_messages(session_id, limit)
-- The newest :limit messages the runtime appended, newest first, with their append's time and
-- tokens: what keep_at: pickup measures the session's appends on (once a run), read backwards
-- on the events' primary key (a compaction's few journal and checkpoint events are skipped).
SELECT seq, created_at, tokens FROM events
 WHERE session_id = :session_id AND kind = 'message'
 ORDER BY seq DESC
 LIMIT :limit;

-- name: poll(session_id)$
-- The runtime's read after every step: one primary-key read.
SELECT surface_version FROM sessions WHERE id = :session_id;

-- name: report_usage(session_id, input_tokens, output_tokens, unappended_tokens, surface_version)^
-- A runtime's report of its provider's usage, before most of its steps: one statement, so a
-- step pays one round trip for it (a transaction around it was three). The report is kept
-- unless it was built on a surface a compaction has since moved past (:surface_version NULL:
-- kept as it is); the row comes back when the report was kept, no row otherwise.
UPDATE sessions
   SET reported_input_tokens = :input_tokens, reported_output_tokens = :output_tokens,
       reported_base_tokens = surface_tokens + envelope_tokens + :unappended_tokens,
       reported_version = surface_version
 WHERE id = :session_id
   AND (CAST(:surface_version AS bigint) IS NULL
        OR (surface_version >= :surface_version
            AND (compacted_version IS NULL OR compacted_version <= :surface_version)))
RETURNING *;

-- name: mark_signal(session_id, now, stale_before)!
-- The pending-signal mark, unless a mark newer than :stale_before is live; of appends racing
-- over the trigger, one sets it.
UPDATE sessions SET signal_at = :now
 WHERE id = :session_id AND (signal_at IS NULL OR signal_at <= :stale_before);

-- name: clear_signal(session_id)^
-- Every automatic run ends with this; it returns the row the worker's follow-up check reads.
UPDATE sessions SET signal_at = NULL WHERE id = :session_id RETURNING *;

-- name: session_runs(session_id, status, since, limit)
-- The loop guard's read after every committed automatic run, on the (session_id, started_at)
-- index.
SELECT * FROM compaction_runs
 WHERE session_id = :session_id AND status = :status AND started_at >= :since
 ORDER BY started_at DESC, id DESC
 LIMIT :limit;

-- name: recent_summary_runs_pg(status_list, since, limit)
-- postgres-only: arrays, unnest and LATERAL are PostgreSQL's (SQLite: recent_summary_runs_sqlite).
-- The newest runs of the statuses in :status_list that wrote a summary (a model is recorded),
-- with their claim, end and stages (the first checkpoint's commit): what a run expects its own
-- claim-to-commit to take (keep_at: pickup). Each status is read in the order of the
-- (status, started_at) index, at most :limit rows, and only those are merged: a fleet's hour of
-- runs is never sorted whole.
SELECT r.status, r.model, r.started_at, r.finished_at, r.stages
  FROM unnest(CAST(:status_list AS text[])) AS s(status)
 CROSS JOIN LATERAL (
       SELECT c.status, c.model, c.started_at, c.finished_at, c.stages FROM compaction_runs c
        WHERE c.status = s.status AND c.started_at >= :since AND c.model IS NOT NULL
          AND c.finished_at IS NOT NULL
        ORDER BY c.started_at DESC
        LIMIT :limit) r
 ORDER BY r.started_at DESC
 LIMIT :limit;

-- name: recent_summary_runs_sqlite(statuses, since, limit)
-- sqlite-only: json_each is SQLite's (PostgreSQL: recent_summary_runs_pg); the statuses come
-- as a JSON array. The newest runs of those statuses that wrote a summary, as the PostgreSQL
-- form returns them.
SELECT status, model, started_at, finished_at, stages FROM compaction_runs
 WHERE status IN (SELECT value FROM json_each(:statuses)) AND started_at >= :since
   AND model IS NOT NULL AND finished_at IS NOT NULL
 ORDER BY started_at DESC
 LIMIT :limit;

-- name: append(session_id, payloads, tokens, now, call_ids, call_idx, call_result_idx, ext_ids, ext_idx, counts, counts_sum, key, request_sha256, key_live_after)^
-- postgres-only: calls compactd_append_v5 (functions/compactd_append_v5.sql); the SQLite connector
-- appends with separate statements in its transaction. The session's row, and with :key the
-- key's row when one answers the append (the key_ columns, as append_key_find names them; NULL
-- when the batch was appended).
SELECT (a.s).*, (a.k).request_sha256 AS key_request_sha256, (a.k).first_seq AS key_first_seq,
       (a.k).last_seq AS key_last_seq, (a.k).surface_version AS key_surface_version,
       (a.k).surface_tokens AS key_surface_tokens,
       (a.k).surface_messages AS key_surface_messages
  FROM compactd_append_v5(:session_id, :payloads, :tokens, :now, :call_ids, :call_idx,
                          :call_result_idx, :ext_ids, :ext_idx, :counts, :counts_sum, :key,
                          :request_sha256, :key_live_after) AS a;

-- name: append_key_find(session_id, key, live_after)^
-- An append made with a key: what the first append with it returned (a row younger than
-- :live_after), beside the session's row; none when the key is new or expired. SQLite's keyed
-- append (PostgreSQL's reads the row inside compactd_append_v5, and the releases at 0021 and
-- 0022 with this statement).
SELECT k.request_sha256 AS key_request_sha256, k.first_seq AS key_first_seq,
       k.last_seq AS key_last_seq, k.surface_version AS key_surface_version,
       k.surface_tokens AS key_surface_tokens, k.surface_messages AS key_surface_messages,
       s.*
  FROM append_keys k JOIN sessions s ON s.id = k.session_id
 WHERE k.session_id = :session_id AND k.key = :key AND k.created_at > :live_after;

-- name: append_key_store(session_id, key, request_sha256, first_seq, last_seq, surface_version, surface_tokens, surface_messages, now, live_after)$
-- Record what the append in the same transaction returned under its key (SQLite's keyed append,
-- and the releases at 0021 and 0022 on PostgreSQL). An expired row is taken over; a live one
-- (another append with the key committed first) is left, no row is returned, and the caller
-- rolls its append back and answers from that row.
INSERT INTO append_keys (session_id, key, request_sha256, first_seq, last_seq,
                         surface_version, surface_tokens, surface_messages, created_at)
VALUES (:session_id, :key, :request_sha256, :first_seq, :last_seq, :surface_version,
        :surface_tokens, :surface_messages, :now)
ON CONFLICT (session_id, key) DO UPDATE
   SET request_sha256 = excluded.request_sha256, first_seq = excluded.first_seq,
       last_seq = excluded.last_seq, surface_version = excluded.surface_version,
       surface_tokens = excluded.surface_tokens, surface_messages = excluded.surface_messages,
       created_at = excluded.created_at
 WHERE append_keys.created_at <= :live_after
RETURNING 1;

-- name: claim_free(session_id, run_id, owner, trigger, expires, now, task_id)^
-- postgres-only: calls compactd_claim_v2 (functions/compactd_claim_v2.sql); on SQLite every claim
-- takes the general path.
SELECT * FROM compactd_claim_v2(:session_id, :run_id, :owner, :trigger, :expires, :now, :task_id);

-- name: commit(session_id, run_id, fence, now, seqs, counts, kinds, payloads, tokens, journal_kinds, journals, expected_pos, expected_seq, end_payload, before, after, refs, firsts, lasts, node_counts, keeps, keep_counts, event)^
-- postgres-only: calls compactd_commit_v4 (functions/compactd_commit_v4.sql); the SQLite connector
-- commits with separate statements in its transaction. The commit's event is sent by pg_notify in
-- the same statement, so a listener hears of the commit once it is visible, and of no commit
-- that was refused or rolled back: :event is built by storage.events (commit_event_fields), and
-- the fields only the commit knows (events.COMMIT_ROW_FIELDS) are added from its row.
SELECT c.*, pg_notify('compactd_events', (:event::jsonb || jsonb_build_object(
           'tenant', c.tenant, 'version', c.surface_version, 'seq', c.last_seq))::text)
           AS notified
  FROM compactd_commit_v4(:session_id, :run_id, :fence, :now, :seqs, :counts, :kinds, :payloads,
                          :tokens, :journal_kinds, :journals, :expected_pos, :expected_seq,
                          :end_payload, :before, :after, :refs, :firsts, :lasts,
                          :node_counts, :keeps, :keep_counts) AS c;

-- name: commit_ending(session_id, run_id, fence, now, seqs, counts, kinds, payloads, tokens, journal_kinds, journals, expected_pos, expected_seq, end_payload, before, after, refs, firsts, lasts, node_counts, keeps, keep_counts, status, failure_class, error, tokens_before, tokens_after, model, usage, candidates, stages, range_seqs, signalled_at, item_state, item_done, event)^
-- postgres-only: a data-modifying WITH around compactd_commit_v4. The commit that ends its run: the
-- run row's result and its bulk item's ride on the call. The run row's UPDATE waits for the call
-- (EXISTS on its result), so the session row is locked before the run row, as everywhere else,
-- and a refused call (moved fence, changed surface) changes nothing. The call does not touch
-- compaction_runs; the run row's UPDATE re-reads the row's newest version if a lease renewal
-- changed it meanwhile, as any UPDATE does. The commit's event as in commit.
WITH c AS (SELECT * FROM compactd_commit_v4(:session_id, :run_id, :fence, :now, :seqs, :counts,
                                         :kinds, :payloads, :tokens, :journal_kinds, :journals,
                                         :expected_pos, :expected_seq, :end_payload, :before,
                                         :after, :refs, :firsts, :lasts, :node_counts,
                                         :keeps, :keep_counts)),
     r AS (UPDATE compaction_runs
              SET status = :status, failure_class = :failure_class, error = :error,
                  tokens_before = :tokens_before, tokens_after = :tokens_after, model = :model,
                  usage = :usage, candidates = :candidates, stages = :stages,
                  range_seqs = :range_seqs, signalled_at = :signalled_at,
                  finished_at = :now, heartbeat_at = :now
            WHERE id = :run_id::text AND EXISTS (SELECT FROM c)
           RETURNING bulk_job_id),
     b AS (UPDATE bulk_items AS i SET state = :item_state, run_id = :run_id::text,
                  updated_at = :now
             FROM r
            WHERE i.job_id = r.bulk_job_id AND i.session_id = :session_id::text
              AND i.state <> :item_done)
SELECT c.*, pg_notify('compactd_events', (:event::jsonb || jsonb_build_object(
           'tenant', c.tenant, 'version', c.surface_version, 'seq', c.last_seq))::text)
           AS notified
  FROM c;

-- name: notify(payload)$
-- postgres-only: SQLite has no LISTEN/NOTIFY (storage.events says what its waiters do). An event
-- of storage.events on the channel compactd_events; inside a transaction it is sent when that
-- commits, and not at all when it rolls back.
SELECT pg_notify('compactd_events', :payload);

-- name: set_timeouts(ms)
-- postgres-only: SQLite has no statement timeout (its transactions wait on the busy timeout,
-- set by the connector). A transaction's lock waits and statements end with the deadline; both
-- settings end with the transaction (is_local), so the pooled connection keeps the server's.
SELECT set_config('lock_timeout', :ms, true), set_config('statement_timeout', :ms, true);

-- name: set_lock_wait(ms)
-- postgres-only: SQLite locks the database, not rows. The general claim's wait for the row, to
-- the end of its transaction (is_local).
SELECT set_config('lock_timeout', :ms, true);
