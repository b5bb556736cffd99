"""Overload degrades in order: a worker takes compaction.urgent before compaction.pressure at
every free slot, whatever order its ``-Q`` names them in.

kombu's Redis transport round-robins between queues by default, so with both loaded every other
slot went to a pressure run while overflows waited. Here both queues are loaded before the one
worker (one slot) starts, pressure named first on its command line, and each run's start is read
from PostgreSQL.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from compactd.scheduler.samples import coding_session
from compactd.storage.records import RunRecord
from tests.support.db import Db
from tests.support.fake_provider import FakeProvider
from tests.support.probes import query
from tests.support.services import empty_database, flush_redis
from tests.support.stack import Stack, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.redis]

POLICY = {"trigger": [{"type": "tokens", "value": 4000}],
          "keep": {"type": "messages", "value": 6}, "model_name": "fake-gpt"}
EACH = 4


def test_urgent_runs_start_before_queued_pressure_runs(pg_schema: str, redis_url: str,
                                                       tmp_path: Path) -> None:
    asyncio.run(empty_database(pg_schema))
    flush_redis(redis_url)
    urgent = [f"urgent-{i}" for i in range(EACH)]
    pressure = [f"pressure-{i}" for i in range(EACH)]
    with FakeProvider() as fake, Stack(pg_schema, redis_url, tmp_path, fake_url=fake.url,
                                       summarization=POLICY) as stack:
        # Seeded through the store, not a CLI process per session; the runs are queued through
        # the CLI below.
        with Db(pg_schema) as db:
            for i, sid in enumerate(pressure + urgent):
                db.ingest(sid, coding_session(steps=20, big_output_lines=30, seed=i).messages)
        # Loaded in turns, each queue's first message before the other's.
        for p, u in zip(pressure, urgent, strict=True):
            assert stack.cli_json("signal", p)["enqueued"], p
            stack.cli("compact", u)
        stack.start_worker("w1", concurrency=1,
                           queues=("compaction.pressure", "compaction.urgent"))

        def ended() -> dict[str, list[RunRecord]] | None:
            runs = {sid: query(pg_schema, lambda s, sid=sid: s.session_runs(sid))
                    for sid in pressure + urgent}
            return runs if all(r and r[0].finished for r in runs.values()) else None

        done = wait_until(ended, timeout=180, what="every run to end")
    assert {sid: [r.trigger for r in done[sid]] for sid in urgent} == {
        sid: ["manual"] for sid in urgent}
    assert {sid: [r.status for r in done[sid]] for sid in pressure + urgent} == {
        sid: ["committed"] for sid in pressure + urgent}
    order = sorted(pressure + urgent, key=lambda sid: done[sid][0].started_at)
    assert order[:EACH] == urgent, order
    assert set(order[EACH:]) == set(pressure), order
