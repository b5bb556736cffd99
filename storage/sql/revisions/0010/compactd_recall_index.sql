-- As revision 0010 created it; revision 0011 changed it to storage/sql/functions' text. Kept
-- for 0010 and 0011's downgrade: a revision's text never changes.
-- Index one replace event (a checkpoint or a pruned result): the originals it is the first to
-- replace go to recall_originals with their text, and the node, named by its footer's ref (or
-- from its span, for a node written before footers), to recall_nodes with the union of the
-- spans it replaced. Idempotent: a second call for the same event adds nothing.
CREATE OR REPLACE FUNCTION compactd_recall_index(p_session text, p_seq bigint, p_kind text, p_payload json)
 RETURNS void
 LANGUAGE plpgsql
AS $function$
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
$function$
