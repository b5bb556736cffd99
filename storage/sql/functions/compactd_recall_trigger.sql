-- The events trigger of migration 0010: every checkpoint or pruned event is indexed as it is
-- inserted, in the transaction of the commit that writes it.
CREATE OR REPLACE FUNCTION compactd_recall_trigger()
 RETURNS trigger
 LANGUAGE plpgsql
AS $function$
BEGIN
  PERFORM compactd_recall_index(NEW.session_id, NEW.seq, NEW.kind, NEW.payload);
  RETURN NULL;
END
$function$
