-- The searchable text of a message payload: its content (a string, or its text blocks), then
-- each tool call's name and arguments, one a line.
CREATE OR REPLACE FUNCTION compactd_recall_body(payload json)
 RETURNS text
 LANGUAGE sql
 IMMUTABLE PARALLEL SAFE
AS $function$
SELECT concat_ws(E'\n',
  CASE json_typeof(payload->'content')
    WHEN 'string' THEN payload->>'content'
    WHEN 'array' THEN (SELECT string_agg(b->>'text', E'\n')
                       FROM json_array_elements(payload->'content') b
                       WHERE b->>'type' = 'text')
  END,
  (SELECT string_agg(concat_ws(' ', c->>1, c->>2), E'\n')
   FROM json_array_elements(CASE json_typeof(payload->'tool_calls') WHEN 'array'
                            THEN payload->'tool_calls' ELSE '[]'::json END) c))
$function$
