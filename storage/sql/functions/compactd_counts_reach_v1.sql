-- Whether some count reaches its floor (storage.counters.reaches): a count left out is 0; no
-- floors never reach.
CREATE OR REPLACE FUNCTION compactd_counts_reach_v1(p_counts json, p_floors json)
 RETURNS boolean
 LANGUAGE sql
 IMMUTABLE
AS $function$
    SELECT coalesce(bool_or(coalesce((p_counts ->> f.key)::bigint, 0) >= f.value::bigint), false)
      FROM json_each_text(p_floors) AS f
$function$
