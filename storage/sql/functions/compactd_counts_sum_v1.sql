-- The sum by name of JSON objects of counts (storage.counters.summed): a name left out of an
-- object is 0, a name whose sum is 0 is left out, and NULL when none is left. The counters
-- kept by name are summed here without the SQL knowing their names.
CREATE OR REPLACE FUNCTION compactd_counts_sum_v1(p_counts json[])
 RETURNS json
 LANGUAGE sql
 IMMUTABLE
AS $function$
    SELECT json_object_agg(t.name, t.total ORDER BY t.name)
      FROM (SELECT e.key AS name, sum(e.value::bigint) AS total
              FROM unnest(p_counts) AS x(counts), json_each_text(x.counts) AS e
             GROUP BY e.key) AS t
     WHERE t.total <> 0
$function$
