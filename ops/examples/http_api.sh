#!/usr/bin/env bash
# The runtime contract over HTTP, for a runtime in any language: create a session, append each
# step, poll the surface by its ETag, report the provider's usage. Needs curl.
#   COMPACTD_URL=http://127.0.0.1:8080 COMPACTD_TOKEN=... bash ops/examples/http_api.sh
set -euo pipefail
API="${COMPACTD_URL:?set COMPACTD_URL}/v1/sessions/curl-demo"
AUTH="Authorization: Bearer ${COMPACTD_TOKEN:?set COMPACTD_TOKEN}"
JSON="Content-Type: application/json"

# Create the session (201), or open it (200). The envelope counts toward pressure.
curl -sS --fail-with-body -X PUT "$API" -H "$AUTH" -H "$JSON" \
  -d '{"run_model": "gpt-4o", "envelope": {"system": "You are a careful coding agent."}}'
echo

# Append one step: a user turn, a tool call and its result, the answer. Pressure is decided in
# the same call; when the trigger fires a worker compacts in the background.
curl -sS --fail-with-body -X POST "$API/messages" -H "$AUTH" -H "$JSON" -d '{"messages": [
  {"role": "user", "content": "Why does tests/test_tax.py fail?"},
  {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
    "function": {"name": "run_tests", "arguments": "{\"path\": \"tests/test_tax.py\"}"}}]},
  {"role": "tool", "tool_call_id": "call_1", "content": "1 failed: CurrencyRoundingError"},
  {"role": "assistant", "content": "A rounding error in billing/tax.py; fixing it."}]}'
echo

# Read the surface (what to send the model) and keep its ETag.
ETAG=$(curl -sS --fail-with-body -D - -o /dev/null "$API/surface" -H "$AUTH" \
  | tr -d '\r' | awk 'tolower($1) == "etag:" {print $2}')
echo "surface version $ETAG"

# Before each model call: 304 while nothing changed (one primary-key read), else the new surface.
curl -sS -o /dev/null -w '%{http_code}\n' "$API/surface" -H "$AUTH" -H "If-None-Match: $ETAG"

# After each model call: the provider's own input and output token counts (before the reply is
# appended, say so: it is then counted once, by output_tokens).
curl -sS --fail-with-body -X POST "$API/usage" -H "$AUTH" -H "$JSON" \
  -d '{"input_tokens": 1830, "output_tokens": 212, "response_appended": false}'
echo
