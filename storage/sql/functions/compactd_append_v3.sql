-- The append: the one write on the agent's critical path, in one round trip (the SQLite
-- connector does the same in Python). Errors carry compactd's SQLSTATEs so storage can name the
-- message and field: CD404 no such session; CD001 a tool-call id reused while its call is open;
-- CD002 a result whose call was never made; CD003 a call already answered. DETAIL is the call
-- id, HINT the message's 0-based index in the batch. growth_rate: records.next_growth_rate
-- over a window of 120 s (records.GROWTH_WINDOW_S). lead_s: the lead of the session's pool
-- (checkpoint_leads, by run model, else '*'), two primary-key reads (worker.lead). p_counts[i]:
-- what message i adds to the counters kept by name (storage.counters; NULL: nothing), stored on
-- its surface row; p_counts_sum their sum, added to the session's counts (NULL: no counter is
-- kept by name, and the counts and their flag are left as they are).
CREATE OR REPLACE FUNCTION compactd_append_v3(p_session text, p_payloads json[], p_tokens integer[], p_now timestamp with time zone, p_call_ids text[], p_call_idx integer[], p_call_result_idx integer[], p_ext_ids text[], p_ext_idx integer[], p_counts json[], p_counts_sum json)
 RETURNS SETOF sessions
 LANGUAGE plpgsql
AS $function$
DECLARE
    n int := cardinality(p_payloads);
    s sessions%ROWTYPE;
    first_seq bigint;
    first_pos bigint;
    bad_id text;
    bad_idx int;
    bad_answered boolean;
BEGIN
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
    RETURN NEXT s;
END;
$function$

