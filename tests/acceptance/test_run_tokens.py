"""A run's token figures on the worker path: what it records as the session's pressure after
its commit is what the commit left, never below it (the fleet simulation saw 1122 -> -648),
and the session's cached totals stay the sum of its surface's nodes.

The append that makes a run's first read larger than the claim's row lands inside the claim
itself (a trigger on the run row the claim inserts calls compactd_append, the runtime's own
append), so the race the fleet hit by chance happens on every run here.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator

import asyncpg
import pytest

from compactd.storage.messages import parse_openai
from tests.support.db import Db
from tests.support.stack import Stack

pytestmark = pytest.mark.slow

MakeStack = Callable[..., Stack]

POLICY = {"trigger": [{"type": "tokens", "value": 8000}],
          "keep": {"type": "messages", "value": 6}, "model_name": "fake-gpt",
          "trim_tokens_to_summarize": 16000}

# Installed for one test: the first run row a claim inserts appends ``messages`` to its
# session in the claim's own transaction, after the claim has read the row it returns.
APPEND_IN_CLAIM = """
CREATE TABLE test_append_in_claim (payloads json[], tokens int[], done boolean);
CREATE FUNCTION test_append_in_claim() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE a test_append_in_claim%ROWTYPE;
BEGIN
    SELECT * INTO a FROM test_append_in_claim WHERE NOT done FOR UPDATE;
    IF NEW.status = 'running' AND FOUND THEN
        UPDATE test_append_in_claim SET done = true;
        PERFORM compactd_append(NEW.session_id, a.payloads, a.tokens, now(), '{}', '{}', '{}',
                                '{}', '{}');
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER test_append_in_claim AFTER INSERT ON compaction_runs
    FOR EACH ROW EXECUTE FUNCTION test_append_in_claim();
"""
REMOVE_APPEND_IN_CLAIM = """
DROP TRIGGER IF EXISTS test_append_in_claim ON compaction_runs;
DROP FUNCTION IF EXISTS test_append_in_claim();
DROP TABLE IF EXISTS test_append_in_claim;
"""


@pytest.fixture
def db(clean_pg: str) -> Iterator[Db]:
    with Db(clean_pg) as handle:
        yield handle


def turn(i: int, words: int) -> dict[str, str]:
    role = "user" if i % 2 == 0 else "assistant"
    return {"role": role, "content": f"turn {i}: " + " ".join(f"word{i}x{j}" for j in
                                                             range(words))}


@pytest.fixture
def append_in_claim(clean_pg: str) -> Iterator[Callable[[list[dict[str, str]], list[int]], None]]:
    """Installs the trigger for the test, and removes it after (the schema is shared)."""

    async def sql(statements: str, *args: object) -> None:
        conn = await asyncpg.connect(clean_pg)
        try:
            await conn.execute(statements, *args)
        finally:
            await conn.close()

    def install(messages: list[dict[str, str]], tokens: list[int]) -> None:
        asyncio.run(sql(REMOVE_APPEND_IN_CLAIM + APPEND_IN_CLAIM))
        asyncio.run(sql("INSERT INTO test_append_in_claim VALUES ($1, $2, false)",
                        [json.dumps(parse_openai(m).to_payload()) for m in messages], tokens))

    yield install
    asyncio.run(sql(REMOVE_APPEND_IN_CLAIM))


def test_a_run_whose_read_is_larger_than_its_claim_records_what_it_left(
        make_stack: MakeStack, db: Db,
        append_in_claim: Callable[[list[dict[str, str]], list[int]], None]) -> None:
    stack = make_stack(summarization=POLICY)
    small = [turn(i, 20) for i in range(8)]
    db.ingest("s1", small, run_model="fake-gpt", context_window=128_000)
    # Large turns, then small ones the kept tail takes: the run replaces the large ones.
    late = [turn(i, 400) for i in range(8, 12)] + [turn(i, 20) for i in range(12, 18)]
    # Their token counts as the store counts them, from a scratch session.
    counted = db.ingest("scratch", late, run_model="fake-gpt", context_window=128_000)
    tokens = [n.tokens for n in db.surface("scratch").nodes]
    assert sum(tokens) == counted.surface_tokens
    append_in_claim(late, tokens)
    claimed_at = db.session("s1")

    stack.start_worker("w1", concurrency=2)
    result = stack.cli_json("compact", "s1", "--wait")
    assert result["outcome"] == "committed", result

    info = db.session("s1")
    verified = db.verify("s1")
    assert verified.ok, verified.problems
    # The append landed inside the claim, before the run read the surface.
    assert info.surface_messages < claimed_at.surface_messages + len(late)
    assert len(db.events("s1", kinds=["message"])) == len(small) + len(late)
    pressure = info.surface_tokens + info.envelope_tokens
    [run] = db.runs("s1")
    # Nothing was appended after the read: what the run recorded is what its commit left.
    assert run.tokens_after == pressure, (run.tokens_before, run.tokens_after, pressure)
    assert result["tokens_after"] == pressure, result
    # What the run started from is what it read: the claim's row plus the append inside it.
    assert run.tokens_before == claimed_at.surface_tokens + sum(tokens) + info.envelope_tokens
