"""Beat's ticks do not queue behind the runs they exist to unblock.

A reap tick expires after its interval, as beat sends it. On compaction.pressure it waited
behind a backlog of pressure runs until it expired and was discarded, and a dead worker's lease
stayed on its session. Here a worker started for compaction.pressure alone (as a deployment's
``-Q`` may name it) has one slot and a backlog of slow runs; the tick, sent after them, must be
taken at the next free slot and reap the lease.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from compactd.scheduler.samples import coding_session
from compactd.storage.kinds import FailureClass, RunCause, RunStatus
from compactd.storage.records import Claim
from compactd.storage.store import Store
from compactd.worker.app import make_app
from compactd.worker.enqueue import Enqueuer, RunRequest
from compactd.worker.keys import TASK_REAP
from compactd.worker.settings import Settings, build_config
from tests.support.db import Db
from tests.support.fake_provider import FakeProvider
from tests.support.services import empty_database, flush_redis
from tests.support.stack import Stack, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.redis, pytest.mark.timed]

POLICY = {"trigger": [{"type": "tokens", "value": 4000}],
          "keep": {"type": "messages", "value": 6}, "model_name": "fake-gpt"}
BACKLOG = 10
MODEL_LATENCY_S = 1.5
# The tick's expiry, as beat sets it (worker.reap_interval_s): far less than the backlog takes.
REAP_EXPIRES_S = 5.0
DEAD = "dead-session"


def test_a_reap_tick_is_taken_ahead_of_a_pressure_backlog(pg_schema: str, redis_url: str,
                                                          tmp_path: Path) -> None:
    asyncio.run(empty_database(pg_schema))
    flush_redis(redis_url)
    backlog = [f"pressure-{i}" for i in range(BACKLOG)]
    app = make_app(build_config({}, settings=Settings(broker_url=redis_url,
                                                      database_url=pg_schema),
                                home=tmp_path))
    with FakeProvider(latency_s=MODEL_LATENCY_S) as fake, \
            Stack(pg_schema, redis_url, tmp_path, fake_url=fake.url,
                  summarization=POLICY) as stack, Db(pg_schema) as db:
        for i, sid in enumerate(backlog):
            db.ingest(sid, coding_session(steps=20, big_output_lines=30, seed=i).messages)
        # Under its trigger, so the reap sends no run for it. Its lease is held by a worker on
        # another host (a worker's start releases its own host's dead ones) and has expired.
        db.ingest(DEAD, coding_session(steps=4, seed=99).messages)

        async def claim(store: Store) -> object:
            return await store.claim(DEAD, owner="gone-host:4242", trigger=RunCause.PRESSURE,
                                     lease_s=0.1)

        dead = db.run(claim)
        assert isinstance(dead, Claim)
        stack.start_worker("w1", concurrency=1, queues=("compaction.pressure",))
        enqueuer = Enqueuer(app)
        for sid in backlog:
            enqueuer.send(RunRequest(sid, RunCause.PRESSURE))
        sent = time.monotonic()
        tick = app.send_task(TASK_REAP, expires=REAP_EXPIRES_S).id

        def fate() -> str | None:
            for line in stack.log("w1").splitlines():
                if f"compaction.reap[{tick}]" in line and "received" not in line:
                    return line
            return None

        line = wait_until(fate, timeout=BACKLOG * MODEL_LATENCY_S * 4,
                          what="the worker to take or discard the reap tick")
        waited = time.monotonic() - sent
        run = next(r for r in db.runs(DEAD) if r.id == dead.run_id)
    assert "succeeded" in line, line
    assert waited < REAP_EXPIRES_S, waited
    assert (run.status, run.failure_class) == (RunStatus.FAILED, FailureClass.ABANDONED), run
