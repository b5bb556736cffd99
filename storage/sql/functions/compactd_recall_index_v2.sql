-- Record one replace node (a checkpoint or a pruned result) for recall, in the transaction of
-- the commit that writes it: the originals it is the first to replace (the message events among
-- p_replaces) go to recall_originals as pending (no text yet: storage/recall_index.py indexes
-- them after the commit, in transactions of their own), and the node to recall_nodes, named by
-- its footer's ref (from its span, for a node written before footers), with the span its
-- meta.recall states (p_first, p_last), else the union of the spans it replaced: a recallable
-- layout's state names everything the layout absorbed, most of which it never replaced itself.
-- No payload is read, so no content can make the commit fail. Idempotent: a second call for the
-- same node adds nothing.
CREATE OR REPLACE FUNCTION compactd_recall_index_v2(p_session text, p_seq bigint, p_kind text, p_ref text, p_first bigint, p_last bigint, p_replaces bigint[])
 RETURNS void
 LANGUAGE plpgsql
AS $function$
DECLARE
  v_first bigint := p_first;
  v_last bigint := p_last;
  v_messages integer;
BEGIN
  WITH added AS (
    INSERT INTO recall_originals (session_id, seq, node_seq, body, bytes)
    SELECT e.session_id, e.seq, p_seq, NULL, 0
    FROM events e
    WHERE e.session_id = p_session AND e.seq = ANY (p_replaces) AND e.kind = 'message'
    ON CONFLICT DO NOTHING
    RETURNING seq)
  SELECT count(*) INTO v_messages FROM added;
  IF v_first IS NULL OR v_last IS NULL THEN
    SELECT min(coalesce(n.first_seq, r.seq)), max(coalesce(n.last_seq, r.seq))
    INTO v_first, v_last
    FROM unnest(p_replaces) AS r(seq)
    LEFT JOIN recall_nodes n ON n.session_id = p_session AND n.seq = r.seq;
  END IF;
  IF v_first IS NULL THEN
    RETURN;
  END IF;
  INSERT INTO recall_nodes (session_id, seq, ref, first_seq, last_seq, messages, bytes)
  VALUES (p_session, p_seq,
          coalesce(p_ref, CASE WHEN p_kind = 'pruned' THEN 'r' || v_first
                               ELSE 'c' || v_first || '-' || v_last END),
          v_first, v_last, v_messages, 0)
  ON CONFLICT DO NOTHING;
END
$function$
