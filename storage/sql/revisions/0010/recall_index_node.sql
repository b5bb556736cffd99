-- recall_index_node as revision 0010 created it (the SQLite trigger's second step and its
-- backfill); revision 0011 changed it to storage/sql/recall.sql's. Kept for 0010 and 0011's
-- downgrade: a revision's text never changes.
-- sqlite-only: the SQLite trigger's second step (PostgreSQL: compactd_recall_index). The node,
-- named by its footer's ref (from its span for a node written before footers), with the union
-- of the spans it replaced and the originals it was the first to replace.
INSERT OR IGNORE INTO recall_nodes (session_id, seq, ref, first_seq, last_seq, messages, bytes)
SELECT :session_id, :seq,
       coalesce(json_extract(:payload, '$.message.meta.recall.ref'),
                CASE WHEN :kind = 'pruned' THEN 'r' || min(coalesce(n.first_seq, r.value))
                     ELSE 'c' || min(coalesce(n.first_seq, r.value)) || '-'
                          || max(coalesce(n.last_seq, r.value)) END),
       min(coalesce(n.first_seq, r.value)), max(coalesce(n.last_seq, r.value)),
       count(o.seq), coalesce(sum(o.bytes), 0)
FROM json_each(:payload, '$.replaces') r
LEFT JOIN recall_nodes n ON n.session_id = :session_id AND n.seq = r.value
LEFT JOIN recall_originals o ON o.session_id = :session_id AND o.seq = r.value
                            AND o.node_seq = :seq
HAVING count(*) > 0;
