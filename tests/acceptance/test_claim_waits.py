"""A claim waits for a session row a short transaction holds, on the worker path: under a steady
stream of runtime writes (each holding the row ~200 ms, as an append or a usage report does for
a moment under load) a queued run commits instead of ending ``busy``. ``busy`` is for a live
lease of another run only."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator

import asyncpg
import pytest

from tests.support.db import Db
from tests.support.stack import Stack, wait_until

pytestmark = pytest.mark.slow

MakeStack = Callable[..., Stack]

POLICY = {"trigger": [{"type": "tokens", "value": 8000}],
          "keep": {"type": "messages", "value": 6}, "model_name": "fake-gpt",
          "trim_tokens_to_summarize": 16000}
HOLD_S = 0.2


@pytest.fixture
def db(clean_pg: str) -> Iterator[Db]:
    with Db(clean_pg) as handle:
        yield handle


class RowWriter:
    """Short transactions on one session's row, back to back, each holding it ``HOLD_S``: the
    runtime's writes as a claim meets them under load."""

    def __init__(self, db_url: str, session_id: str) -> None:
        self.db_url, self.session_id = db_url, session_id
        self.held = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    async def _run(self) -> None:
        conn = await asyncpg.connect(self.db_url)
        try:
            while not self.stop.is_set():
                async with conn.transaction():
                    await conn.execute("UPDATE sessions SET last_append_at = now() WHERE id = $1",
                                       self.session_id)
                    await asyncio.sleep(HOLD_S)
                self.held += 1
        finally:
            await conn.close()

    def __enter__(self) -> RowWriter:
        self.thread.start()
        wait_until(lambda: self.held > 0, timeout=10, what="the first row write")
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=10)


def turn(i: int) -> dict[str, str]:
    role = "user" if i % 2 == 0 else "assistant"
    return {"role": role, "content": f"turn {i}: " + " ".join(f"w{i}x{j}" for j in range(80))}


def test_a_claim_waits_for_short_row_writes_and_the_run_commits(
        make_stack: MakeStack, db: Db, clean_pg: str) -> None:
    stack = make_stack(summarization=POLICY)
    db.ingest("s1", [turn(i) for i in range(20)], run_model="fake-gpt")
    stack.start_worker("w1", concurrency=2)
    with RowWriter(clean_pg, "s1") as writer:
        result = stack.cli_json("compact", "s1", "--wait", check=False)
        during = writer.held
    assert result["outcome"] == "committed", result
    runs = db.runs("s1")
    assert [(r.status, r.failure_class) for r in runs] == [("committed", None)], runs
    # The writes went on through the run: the claim met them (and the commit too).
    assert during >= 3, during
    assert db.verify("s1").ok
