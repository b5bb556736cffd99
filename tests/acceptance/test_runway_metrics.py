"""The runway, the queues and the pending signals as a real worker exports them.

One worker (metrics on a free port) takes the pressure and bulk queues, not urgent. A session
over its trigger is signalled and compacted (pressure-to-checkpoint observed once); a manual
request waits on compaction.urgent; another session over its trigger carries a pending-signal
mark no run has taken yet. Then beat's sweep task runs on the worker, and its scrape must agree with
PostgreSQL.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import subprocess
import sys
from pathlib import Path

import pytest

from compactd.scheduler.samples import coding_session
from compactd.storage.records import utcnow
from compactd.worker.pressure import sorted_runways
from compactd.worker.settings import load_config
from tests.support.fake_provider import FakeProvider
from tests.support.metrics import scrape, value
from tests.support.probes import free_port, query
from tests.support.services import empty_database, flush_redis
from tests.support.stack import Stack, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.redis]

POLICY = {"trigger": [{"type": "tokens", "value": 4000}],
          "keep": {"type": "messages", "value": 6}, "model_name": "fake-gpt"}
MARK_AGE_S = 8.0


def test_a_sweep_exports_runway_queue_depth_and_signal_age(
        pg_schema: str, redis_url: str, tmp_path: Path) -> None:
    asyncio.run(empty_database(pg_schema))
    flush_redis(redis_url)
    port = free_port()
    with FakeProvider() as fake, Stack(pg_schema, redis_url, tmp_path, fake_url=fake.url,
                                       summarization=POLICY) as stack:
        stack.ingest("over", coding_session(steps=20, big_output_lines=30, seed=1).messages)
        # Under the trigger: the sweep leaves it alone.
        stack.ingest("queued", coding_session(steps=2, seed=2).messages)
        # Over it, with a mark younger than a sweep interval: the sweep passes it over.
        stack.ingest("pending", coding_session(steps=20, big_output_lines=30, seed=3).messages)
        stack.start_worker("w1", concurrency=2, queues=("compaction.pressure", "compaction.bulk"),
                           env={"COMPACTD_METRICS_PORT": str(port)})
        signalled = utcnow()
        assert stack.cli_json("signal", "over")["enqueued"]
        wait_until(lambda: value(scrape(port), "compactd_pressure_to_checkpoint_seconds_count",
                                 trigger="pressure") >= 1, timeout=90, what="the pressure run")
        checkpointed = utcnow()
        assert "compactd_runway_min_seconds" not in {name for name, _ in scrape(port)}

        stack.cli("compact", "queued")  # compaction.urgent, which w1 does not take
        marked = utcnow() - dt.timedelta(seconds=MARK_AGE_S)
        assert query(pg_schema, lambda s: s.mark_signal("pending", ttl_s=600, now=marked))

        swept = utcnow()
        subprocess.run([sys.executable, "-m", "celery", "-A", "compactd.worker.app", "call",
                        "compaction.sweep"], env=stack.env, cwd=stack.home, check=True,
                       capture_output=True, timeout=60)

        def after_sweep() -> dict[tuple[str, tuple[tuple[str, str], ...]], float] | None:
            now = scrape(port)
            return now if value(now, "compactd_sessions_runway", le="+Inf") else None

        samples = wait_until(after_sweep, timeout=60, what="the sweep")
        scraped = utcnow()

    # The pressure run: one observation, no longer than from the signal to the commit seen.
    assert value(samples, "compactd_pressure_to_checkpoint_seconds_count",
                 trigger="pressure") == 1
    took = value(samples, "compactd_pressure_to_checkpoint_seconds_sum", trigger="pressure")
    assert 0 < took <= (checkpointed - signalled).total_seconds()

    assert value(samples, "compactd_queue_depth", queue="compaction.urgent") == 1
    assert value(samples, "compactd_queue_depth", queue="compaction.pressure") == 0
    assert value(samples, "compactd_queue_depth", queue="compaction.bulk") == 0
    age = value(samples, "compactd_oldest_signal_age_seconds")
    assert MARK_AGE_S <= age <= (scraped - marked).total_seconds()

    # Every session appended once (its ingest) and so is growing; the least runway is the one
    # PostgreSQL gives between the sweep's call and the scrape (it lengthens as rates decay).
    config = load_config(stack.env)
    infos = query(pg_schema, lambda s: s.growing_sessions(now=scraped))
    assert {i.id for i in infos} == {"over", "queued", "pending"}
    assert value(samples, "compactd_sessions_runway", le="+Inf") == 3
    lo = sorted_runways(infos, config, swept)[0].seconds
    hi = sorted_runways(infos, config, scraped)[0].seconds
    assert lo <= value(samples, "compactd_runway_min_seconds") <= hi
