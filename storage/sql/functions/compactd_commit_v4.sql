-- A compaction's replacements in one round trip; with p_end the compaction/end event is written
-- last and the lease cleared (the run row's end rides on the same statement: commit_ending in
-- queries.sql). Replacements come flattened: p_seqs holds every replaced seq, p_counts[i] how
-- many replacement i names; p_expected_pos/p_expected_seq is the surface prefix the plan read
-- (NULL: no check). p_before[i]/p_after[i] place replacement i's node (storage/surface.py):
-- directly before a node that directly precedes its run (the two swap positions), or, naming
-- nothing, into the free position directly after a node; either names a node on the surface
-- or a seq an earlier replacement of this call replaced. Both NULL (the arrays, or their
-- elements): the node takes its run's first position. Replacements apply in order, each to
-- the surface the one before it left; with no placement at all the surface rows are written
-- in one batch after every check. Errors, before anything is kept: CD404 no such session;
-- CD409 the fence or run moved (DETAIL: the current fence); CD410 the surface changed (DETAIL
-- prefix, or order:i / contiguous:i / before:i / after:i for the 1-based replacement i).
-- p_refs[i], p_firsts[i], p_lasts[i]: node i's recall name and span as its meta.recall states
-- them (NULL: none stated). Each node is recorded for recall (compactd_recall_index) without
-- reading a payload; the originals' text is indexed after the commit, outside the row lock.
-- p_node_counts[i]: what node i adds to the counters kept by name (storage.counters; NULL, the
-- array or its element: nothing). When the session keeps any, its counts are summed again from
-- its surface rows once they are written, with whether they reach their floors.
-- p_keeps, p_keep_counts (the v4 change): flattened as p_seqs, the nodes inside replacement i's
-- run that stay where they are (NULL, the arrays, or a count of 0: none). The replaced and the
-- kept seqs together must be the contiguous run, each kept node strictly inside it (else
-- CD410 order:i / contiguous:i), and the new node takes the first replaced position after the
-- last kept node; a replacement that keeps nodes is not placed.
CREATE OR REPLACE FUNCTION compactd_commit_v4(p_session text, p_run_id text, p_fence bigint, p_now timestamp with time zone, p_seqs bigint[], p_counts integer[], p_kinds text[], p_payloads json[], p_tokens integer[], p_journal_kinds text[], p_journals json[], p_expected_pos bigint[], p_expected_seq bigint[], p_end json, p_before bigint[], p_after bigint[], p_refs text[], p_firsts bigint[], p_lasts bigint[], p_node_counts json[], p_keeps bigint[], p_keep_counts integer[])
 RETURNS SETOF sessions
 LANGUAGE plpgsql
AS $function$
DECLARE
    s sessions%ROWTYPE;
    n int := coalesce(cardinality(p_counts), 0);
    placed boolean := p_before IS NOT NULL OR p_after IS NOT NULL;
    i int;
    h int;
    k int;
    off int := 0;
    offs int[] := '{}';
    next_seq bigint;
    firsts bigint[] := '{}';
    found_n int;
    named_tokens bigint;
    first_pos bigint;
    last_pos bigint;
    in_order boolean;
    between_n bigint;
    got_pos bigint[];
    got_seq bigint[];
    target bigint;
    target_pos bigint;
    at_pos bigint;
    d_tokens bigint := 0;
    d_nodes int := 0;
    recount boolean;
    new_counts json;
    koff int := 0;
    kn int;
    kept bigint[];
    kept_in int;
    last_kept bigint;
BEGIN
    SELECT * INTO s FROM sessions WHERE id = p_session FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION USING ERRCODE = 'CD404', MESSAGE = 'no such session', DETAIL = p_session;
    END IF;
    IF s.lease_fence IS DISTINCT FROM p_fence OR s.lease_run_id IS DISTINCT FROM p_run_id THEN
        RAISE EXCEPTION USING ERRCODE = 'CD409', MESSAGE = 'lease lost',
              DETAIL = s.lease_fence::text;
    END IF;

    -- The prefix the plan read, through the last node it replaces: appends after it are fine.
    IF p_expected_pos IS NOT NULL AND cardinality(p_expected_pos) > 0 THEN
        SELECT coalesce(array_agg(f.position ORDER BY f.position), '{}'),
               coalesce(array_agg(f.seq ORDER BY f.position), '{}')
          INTO got_pos, got_seq
          FROM surface f
         WHERE f.session_id = p_session
           AND f.position <= (SELECT max(x) FROM unnest(p_expected_pos) AS x);
        IF got_pos <> p_expected_pos OR got_seq <> p_expected_seq THEN
            RAISE EXCEPTION USING ERRCODE = 'CD410', MESSAGE = 'surface changed',
                  DETAIL = 'prefix';
        END IF;
    END IF;

    -- Every replacement names seqs on the surface, in that order, as one contiguous run (or,
    -- placed after a node, none); a placed one is applied before the next is checked.
    next_seq := s.last_seq;
    FOR i IN 1..n LOOP
        k := p_counts[i];
        offs := offs || off;
        named_tokens := 0;
        first_pos := NULL;
        kn := coalesce(p_keep_counts[i], 0);
        kept := CASE WHEN kn > 0 THEN p_keeps[koff + 1:koff + kn] ELSE '{}' END;
        koff := koff + kn;
        IF kn > 0 AND k = 0 THEN
            RAISE EXCEPTION USING ERRCODE = 'CD410', MESSAGE = 'surface changed',
                  DETAIL = 'order:' || i;
        END IF;
        IF k > 0 THEN
            SELECT count(*), coalesce(sum(r.tokens), 0), min(r.position), max(r.position),
                   coalesce(bool_and(r.ok), true)
              INTO found_n, named_tokens, first_pos, last_pos, in_order
              FROM (SELECT f.position, f.tokens,
                           (f.position > lag(f.position) OVER (ORDER BY x.ord)) IS NOT FALSE AS ok
                      FROM unnest(p_seqs[off + 1:off + k]) WITH ORDINALITY AS x(seq, ord)
                      JOIN surface f ON f.session_id = p_session AND f.seq = x.seq) AS r;
            IF found_n <> k OR NOT in_order THEN
                RAISE EXCEPTION USING ERRCODE = 'CD410', MESSAGE = 'surface changed',
                      DETAIL = 'order:' || i;
            END IF;
            IF kn > 0 THEN
                SELECT count(*), max(f.position) INTO kept_in, last_kept FROM surface f
                 WHERE f.session_id = p_session AND f.seq = ANY (kept)
                   AND f.position > first_pos AND f.position < last_pos;
                IF kept_in <> kn OR cardinality(ARRAY(SELECT DISTINCT unnest(kept))) <> kn
                   OR p_before[i] IS NOT NULL OR p_after[i] IS NOT NULL THEN
                    RAISE EXCEPTION USING ERRCODE = 'CD410', MESSAGE = 'surface changed',
                          DETAIL = 'order:' || i;
                END IF;
            END IF;
            IF k > 1 THEN
                SELECT count(*) INTO between_n FROM surface f
                 WHERE f.session_id = p_session AND f.position BETWEEN first_pos AND last_pos;
                IF between_n <> k + kn THEN
                    RAISE EXCEPTION USING ERRCODE = 'CD410', MESSAGE = 'surface changed',
                          DETAIL = 'contiguous:' || i;
                END IF;
            END IF;
        END IF;
        at_pos := first_pos;
        IF kn > 0 THEN
            SELECT min(f.position) INTO at_pos FROM surface f
             WHERE f.session_id = p_session AND f.seq = ANY (p_seqs[off + 1:off + k])
               AND f.position > last_kept;
        END IF;
        target := coalesce(p_before[i], p_after[i]);
        target_pos := NULL;
        IF target IS NOT NULL THEN
            SELECT f.position INTO target_pos FROM surface f
             WHERE f.session_id = p_session AND f.seq = target;
            IF NOT FOUND THEN
                -- A seq an earlier replacement of this call replaced: its new node.
                FOR h IN 1..i - 1 LOOP
                    IF target = ANY (p_seqs[offs[h] + 1:offs[h] + p_counts[h]]) THEN
                        target := next_seq + 2 * h;
                        SELECT f.position INTO target_pos FROM surface f
                         WHERE f.session_id = p_session AND f.seq = target;
                        EXIT;
                    END IF;
                END LOOP;
            END IF;
        END IF;
        IF p_before[i] IS NOT NULL THEN
            IF k = 0 OR p_after[i] IS NOT NULL OR target_pos IS NULL OR target_pos >= first_pos
               OR EXISTS (SELECT FROM surface f WHERE f.session_id = p_session
                            AND f.position > target_pos AND f.position < first_pos) THEN
                RAISE EXCEPTION USING ERRCODE = 'CD410', MESSAGE = 'surface changed',
                      DETAIL = 'before:' || i;
            END IF;
            at_pos := target_pos;
        ELSIF p_after[i] IS NOT NULL THEN
            IF k > 0 OR target_pos IS NULL
               OR EXISTS (SELECT FROM surface f WHERE f.session_id = p_session
                            AND f.position = target_pos + 1) THEN
                RAISE EXCEPTION USING ERRCODE = 'CD410', MESSAGE = 'surface changed',
                      DETAIL = 'after:' || i;
            END IF;
            at_pos := target_pos + 1;
        ELSIF k = 0 THEN
            RAISE EXCEPTION USING ERRCODE = 'CD410', MESSAGE = 'surface changed',
                  DETAIL = 'order:' || i;
        END IF;
        IF placed THEN
            DELETE FROM surface f WHERE f.session_id = p_session
               AND f.seq = ANY (p_seqs[off + 1:off + k]);
            IF p_before[i] IS NOT NULL THEN
                UPDATE surface f SET position = first_pos
                 WHERE f.session_id = p_session AND f.seq = target;
            END IF;
            INSERT INTO surface (session_id, position, seq, tokens, counts)
            VALUES (p_session, at_pos, next_seq + 2 * i, p_tokens[i], p_node_counts[i]);
        END IF;
        firsts := firsts || at_pos;
        d_tokens := d_tokens + p_tokens[i] - named_tokens;
        d_nodes := d_nodes + 1 - k;
        off := off + k;
    END LOOP;

    -- Journal entry, then the node, per replacement; unplaced, the new node takes the place of
    -- the first node it replaces.
    IF n > 0 THEN
        INSERT INTO events (session_id, seq, kind, payload, tokens, run_id, created_at)
        SELECT p_session, next_seq + 2 * j - 1, p_journal_kinds[j], p_journals[j], NULL,
               p_run_id, p_now
          FROM generate_series(1, n) AS j
        UNION ALL
        SELECT p_session, next_seq + 2 * j, p_kinds[j], p_payloads[j], p_tokens[j], p_run_id,
               p_now
          FROM generate_series(1, n) AS j;
        FOR i IN 1..n LOOP
            PERFORM compactd_recall_index_v2(p_session, next_seq + 2 * i, p_kinds[i], p_refs[i],
                                          p_firsts[i], p_lasts[i],
                                          p_seqs[offs[i] + 1:offs[i] + p_counts[i]]);
        END LOOP;
        IF NOT placed THEN
            DELETE FROM surface f WHERE f.session_id = p_session AND f.seq = ANY (p_seqs);
            INSERT INTO surface (session_id, position, seq, tokens, counts)
            SELECT p_session, firsts[j], next_seq + 2 * j, p_tokens[j], p_node_counts[j]
              FROM generate_series(1, n) AS j;
        END IF;
        next_seq := next_seq + 2 * n;
    END IF;
    IF p_end IS NOT NULL THEN
        -- compaction/end is the last event, in the same transaction as the checkpoint.
        next_seq := next_seq + 1;
        INSERT INTO events (session_id, seq, kind, payload, tokens, run_id, created_at)
        VALUES (p_session, next_seq, 'compaction/end', p_end, NULL, p_run_id, p_now);
    END IF;
    recount := n > 0 AND (s.counts IS NOT NULL OR p_node_counts IS NOT NULL);
    IF recount THEN
        SELECT compactd_counts_sum_v1(array_agg(f.counts)) INTO new_counts
          FROM surface f WHERE f.session_id = p_session AND f.counts IS NOT NULL;
    END IF;
    UPDATE sessions
       SET last_seq = next_seq,
           surface_version = surface_version + CASE WHEN n > 0 THEN 1 ELSE 0 END,
           surface_tokens = surface_tokens + d_tokens,
           surface_messages = surface_messages + d_nodes,
           reported_input_tokens = CASE WHEN n > 0 THEN NULL ELSE reported_input_tokens END,
           reported_version = CASE WHEN n > 0 THEN NULL ELSE reported_version END,
           compacted_version = CASE WHEN n > 0 THEN surface_version + 1
                                    ELSE compacted_version END,
           compacted_tokens = CASE WHEN n > 0 THEN surface_tokens + d_tokens + envelope_tokens
                                   ELSE compacted_tokens END,
           lease_owner = CASE WHEN p_end IS NULL THEN lease_owner END,
           lease_run_id = CASE WHEN p_end IS NULL THEN lease_run_id END,
           lease_expires_at = CASE WHEN p_end IS NULL THEN lease_expires_at END,
           counts = CASE WHEN recount THEN new_counts ELSE counts END,
           over_counts = CASE WHEN recount THEN compactd_counts_reach_v1(new_counts, sweep_counts)
                              ELSE over_counts END
     WHERE id = p_session
    RETURNING * INTO s;
    RETURN NEXT s;
END;
$function$
