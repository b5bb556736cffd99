"""A run's recorded pressure after its commit, on the embedded SQLite, in process with the local
summarizer: the SQLite twin of ``tests/acceptance/test_run_tokens.py`` (a real worker on
PostgreSQL). An append lands between the claim and the run's read of the surface; the run
replaces part of it, and must record what its commit left, not the claim's row minus what it
replaced (negative).

SQLite has no compactd_append to call from a trigger: the trigger below writes what an append
of the staged messages writes (events, surface nodes, the session's totals), in the claim's own
transaction after the claim has read the row it returns.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

from compactd.storage.database import embedded_url
from compactd.storage.messages import parse_openai
from compactd.worker.orchestration import compact
from compactd.worker.runtime import open_deps
from compactd.worker.settings import Settings, build_config

APPEND_IN_CLAIM = """
CREATE TABLE test_append_in_claim (i INTEGER, payload TEXT, tokens INTEGER);
CREATE TABLE test_append_in_claim_done (done INTEGER);
INSERT INTO test_append_in_claim_done VALUES (0);
CREATE TRIGGER test_append_in_claim AFTER INSERT ON compaction_runs
WHEN NEW.status = 'running' AND (SELECT done FROM test_append_in_claim_done) = 0
BEGIN
    UPDATE test_append_in_claim_done SET done = 1;
    INSERT INTO events (session_id, seq, kind, payload, tokens, created_at)
    SELECT NEW.session_id, s.last_seq + a.i, 'message', a.payload, a.tokens, NEW.started_at
      FROM test_append_in_claim a, sessions s WHERE s.id = NEW.session_id;
    INSERT INTO surface (session_id, position, seq, tokens)
    SELECT NEW.session_id, s.last_position + a.i, s.last_seq + a.i, a.tokens
      FROM test_append_in_claim a, sessions s WHERE s.id = NEW.session_id;
    UPDATE sessions
       SET last_seq = last_seq + (SELECT count(*) FROM test_append_in_claim),
           last_position = last_position + (SELECT count(*) FROM test_append_in_claim),
           surface_version = surface_version + 1,
           surface_tokens = surface_tokens + (SELECT sum(tokens) FROM test_append_in_claim),
           surface_messages = surface_messages + (SELECT count(*) FROM test_append_in_claim)
     WHERE id = NEW.session_id;
END;
"""


def turn(i: int, words: int) -> dict[str, str]:
    role = "user" if i % 2 == 0 else "assistant"
    return {"role": role, "content": f"turn {i}: " + " ".join(f"word{i}x{j}" for j in
                                                             range(words))}


async def test_a_run_whose_read_is_larger_than_its_claim_records_what_it_left_sqlite(
        tmp_path: Path) -> None:
    raw = {"summarization": {"trigger": [{"type": "tokens", "value": 8000}],
                             "keep": {"type": "messages", "value": 6},
                             "trim_tokens_to_summarize": 16000}}
    config = build_config(raw, settings=Settings(home=str(tmp_path)), home=tmp_path)
    assert config.database_url == embedded_url(tmp_path)
    small = [parse_openai(turn(i, 20)) for i in range(8)]
    late = [parse_openai(turn(i, 400)) for i in range(8, 12)] + [
        parse_openai(turn(i, 20)) for i in range(12, 18)]
    async with open_deps(config, owner="test") as deps:
        store = deps.store
        await store.create_session("s1", run_model="gpt-4o")
        claimed_at = (await store.append("s1", small)).session
        # The staged messages' token counts as the store counts them, from a scratch session.
        await store.create_session("scratch", run_model="gpt-4o")
        tokens = (await store.append("scratch", late)).tokens
        other = sqlite3.connect(config.database_url.split(":///", 1)[1], isolation_level=None)
        try:
            other.executescript(APPEND_IN_CLAIM)
            other.executemany("INSERT INTO test_append_in_claim VALUES (?, ?, ?)",
                              [(i, json.dumps(m.to_payload()), n)
                               for i, (m, n) in enumerate(zip(late, tokens, strict=True), 1)])
        finally:
            other.close()

        out = await compact(deps, "s1", trigger="manual")
        info = await store.get_session("s1")
        verified = await store.verify("s1")
        [run] = await store.session_runs("s1")
    assert out.outcome == "committed", out
    assert verified.ok, verified.problems
    pressure = info.surface_tokens + info.envelope_tokens
    assert (out.tokens_after, run.tokens_after) == (pressure, pressure), (run.tokens_before,
                                                                          run.tokens_after)
    assert run.tokens_before == claimed_at.surface_tokens + sum(tokens) + info.envelope_tokens
