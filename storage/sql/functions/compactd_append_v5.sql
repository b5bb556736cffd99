-- The append, with or without the client's idempotency key, in one round trip (the SQLite
-- connector does the same in Python): compactd_append_v4's, which also keeps step_tokens, the
-- session's largest recent step (records.step_tokens_after: 0 after the first append, then the
-- larger of the batch's tokens and the previous value times records.STEP_DECAY). Errors, the
-- key's check, replay and record, growth_rate, lead_s, p_counts and p_counts_sum: as in
-- compactd_append_v4.
CREATE OR REPLACE FUNCTION compactd_append_v5(p_session text, p_payloads json[], p_tokens integer[], p_now timestamp with time zone, p_call_ids text[], p_call_idx integer[], p_call_result_idx integer[], p_ext_ids text[], p_ext_idx integer[], p_counts json[], p_counts_sum json, p_key text, p_request_sha256 text, p_key_live_after timestamp with time zone)
 RETURNS TABLE(s sessions, k append_keys)
 LANGUAGE plpgsql
AS $function$
DECLARE
    n int := cardinality(p_payloads);
    first_seq bigint;
    first_pos bigint;
    bad_id text;
    bad_idx int;
    bad_answered boolean;
BEGIN
    IF p_key IS NOT NULL THEN
        SELECT * INTO k FROM append_keys
         WHERE session_id = p_session AND key = p_key AND created_at > p_key_live_after;
        IF NOT FOUND THEN
            PERFORM FROM sessions WHERE id = p_session FOR NO KEY UPDATE;
            IF NOT FOUND THEN
                RAISE EXCEPTION USING ERRCODE = 'CD404', MESSAGE = 'no such session', DETAIL = p_session;
            END IF;
            SELECT * INTO k FROM append_keys
             WHERE session_id = p_session AND key = p_key AND created_at > p_key_live_after;
        END IF;
        IF FOUND THEN
            SELECT * INTO s FROM sessions WHERE id = p_session;
            RETURN NEXT;
            RETURN;
        END IF;
    END IF;

    UPDATE sessions
       SET last_seq = last_seq + n,
           last_position = last_position + n,
           surface_version = surface_version + 1,
           surface_tokens = surface_tokens + (SELECT coalesce(sum(t), 0) FROM unnest(p_tokens) t),
           surface_messages = surface_messages + n,
           last_append_at = p_now,
           growth_rate = (growth_rate * 120 + (SELECT coalesce(sum(t), 0) FROM unnest(p_tokens) t))
                         / (120 + greatest(0, extract(epoch FROM
                               p_now - coalesce(last_append_at, created_at)))),
           step_tokens = CASE WHEN last_append_at IS NULL THEN 0
                              ELSE greatest(step_tokens * 0.95,
                                            (SELECT coalesce(sum(t), 0) FROM unnest(p_tokens) t))
                         END,
           lead_s = coalesce((SELECT l.lead_s FROM checkpoint_leads l
                               WHERE l.pool = coalesce(sessions.run_model, '')),
                             (SELECT l.lead_s FROM checkpoint_leads l WHERE l.pool = '*'), 0),
           counts = CASE WHEN p_counts_sum IS NULL THEN counts
                         ELSE compactd_counts_sum_v1(ARRAY[counts, p_counts_sum]) END,
           over_counts = CASE WHEN p_counts_sum IS NULL THEN over_counts
                              ELSE compactd_counts_reach_v1(
                                       compactd_counts_sum_v1(ARRAY[counts, p_counts_sum]),
                                       sweep_counts) END
     WHERE id = p_session
    RETURNING * INTO s;
    IF NOT FOUND THEN
        RAISE EXCEPTION USING ERRCODE = 'CD404', MESSAGE = 'no such session', DETAIL = p_session;
    END IF;
    first_seq := s.last_seq - n;
    first_pos := s.last_position - n;

    -- Results answering calls from before the batch close them first: the batch may issue
    -- those ids again. Each must answer an open call (at most one row per id is open).
    IF cardinality(p_ext_ids) > 0 THEN
        SELECT x.id, x.idx, EXISTS (SELECT 1 FROM tool_calls t2 WHERE t2.session_id = p_session
                                                                 AND t2.call_id = x.id)
          INTO bad_id, bad_idx, bad_answered
          FROM unnest(p_ext_ids, p_ext_idx) AS x(id, idx)
         WHERE NOT EXISTS (SELECT 1 FROM tool_calls t WHERE t.session_id = p_session
                              AND t.call_id = x.id AND t.result_seq IS NULL)
         ORDER BY x.idx LIMIT 1;
        IF bad_id IS NOT NULL THEN
            RAISE EXCEPTION USING
                  ERRCODE = CASE WHEN bad_answered THEN 'CD003' ELSE 'CD002' END,
                  MESSAGE = 'tool result link', DETAIL = bad_id, HINT = bad_idx::text;
        END IF;
        UPDATE tool_calls t SET result_seq = first_seq + x.idx + 1
          FROM unnest(p_ext_ids, p_ext_idx) AS x(id, idx)
         WHERE t.session_id = p_session AND t.call_id = x.id AND t.result_seq IS NULL;
    END IF;

    -- A call may reuse an id only once the earlier call with it has its result.
    IF cardinality(p_call_ids) > 0 THEN
        SELECT c.id, c.idx INTO bad_id, bad_idx
          FROM unnest(p_call_ids, p_call_idx) AS c(id, idx)
          JOIN tool_calls t ON t.session_id = p_session AND t.call_id = c.id
                           AND t.result_seq IS NULL
         ORDER BY c.idx LIMIT 1;
        IF bad_id IS NOT NULL THEN
            RAISE EXCEPTION USING ERRCODE = 'CD001', MESSAGE = 'tool call id reused',
                  DETAIL = bad_id, HINT = bad_idx::text;
        END IF;
        INSERT INTO tool_calls (session_id, call_id, call_seq, result_seq)
        SELECT p_session, c.id, first_seq + c.idx + 1,
               CASE WHEN c.ridx IS NULL THEN NULL ELSE first_seq + c.ridx + 1 END
          FROM unnest(p_call_ids, p_call_idx, p_call_result_idx) AS c(id, idx, ridx);
    END IF;

    INSERT INTO events (session_id, seq, kind, payload, tokens, created_at)
    SELECT p_session, first_seq + i, 'message', p_payloads[i], p_tokens[i], p_now
      FROM generate_subscripts(p_payloads, 1) AS i;
    INSERT INTO surface (session_id, position, seq, tokens, counts)
    SELECT p_session, first_pos + i, first_seq + i, p_tokens[i], p_counts[i]
      FROM generate_subscripts(p_payloads, 1) AS i;
    IF p_key IS NOT NULL THEN
        INSERT INTO append_keys (session_id, key, request_sha256, first_seq, last_seq,
                                 surface_version, surface_tokens, surface_messages, created_at)
        VALUES (p_session, p_key, p_request_sha256, first_seq + 1, s.last_seq, s.surface_version,
                s.surface_tokens, s.surface_messages, p_now)
        ON CONFLICT (session_id, key) DO UPDATE
           SET request_sha256 = excluded.request_sha256, first_seq = excluded.first_seq,
               last_seq = excluded.last_seq, surface_version = excluded.surface_version,
               surface_tokens = excluded.surface_tokens,
               surface_messages = excluded.surface_messages, created_at = excluded.created_at;
    END IF;
    RETURN NEXT;
END;
$function$

