-- The claim of a session with no lease, in one round trip. A leased session, or one with an
-- expired lease to close, is returned unchanged: the caller's general path
-- (LeasesMixin._claim_once) records the busy attempt or closes the lease. The row lock waits up
-- to lock_timeout (storage.leases.CLAIM_LOCK_WAIT_S) for the short transactions that hold it;
-- 55P03 when it stays locked. CD404: no such session.
CREATE OR REPLACE FUNCTION compactd_claim_v2(p_session text, p_run_id text, p_owner text, p_trigger text, p_expires timestamp with time zone, p_now timestamp with time zone, p_task_id text)
 RETURNS SETOF sessions
 LANGUAGE plpgsql
 SET lock_timeout TO '5s'
AS $function$
DECLARE
    s sessions%ROWTYPE;
    new_fence bigint;
    start_seq bigint;
BEGIN
    SELECT * INTO s FROM sessions WHERE id = p_session FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION USING ERRCODE = 'CD404', MESSAGE = 'no such session', DETAIL = p_session;
    END IF;
    IF s.lease_run_id IS NOT NULL
       OR (s.lease_expires_at IS NOT NULL AND s.lease_expires_at > p_now) THEN
        -- Leased, or an expired lease to close first: the caller's general path decides.
        RETURN NEXT s;
        RETURN;
    END IF;
    new_fence := s.lease_fence + 1;
    start_seq := s.last_seq + 1;
    INSERT INTO events (session_id, seq, kind, payload, tokens, run_id, created_at)
    VALUES (p_session, start_seq, 'compaction/start',
            json_build_object('run_id', p_run_id, 'trigger', p_trigger, 'owner', p_owner,
                              'fence', new_fence, 'surface_version', s.surface_version),
            NULL, p_run_id, p_now);
    UPDATE sessions
       SET last_seq = start_seq, lease_owner = p_owner, lease_run_id = p_run_id,
           lease_expires_at = p_expires, lease_fence = new_fence
     WHERE id = p_session
    RETURNING * INTO s;
    INSERT INTO compaction_runs (id, session_id, trigger, status, owner, fence, task_id,
                                 surface_version_at_start, started_at, heartbeat_at)
    VALUES (p_run_id, p_session, p_trigger, 'running', p_owner, new_fence, p_task_id,
            s.surface_version, p_now, p_now);
    RETURN NEXT s;
END;
$function$

