"""Redis down for a while under a running fleet (issue 29, item 5), on real processes.

A Celery worker and beat run against a redis-server of the test's own; a runtime (the async
client, in this process) appends to a few sessions. Redis is killed and stays down while the
runtime keeps appending, each session crossing its trigger during the outage: every append is
stored (appends never need Redis), the signals the appends hand to the broker fail in the
background and are logged, and the worker and beat stay up. Redis comes back empty: the pressure
sweep finds every session over its trigger and the worker compacts it, with nothing lost.

The outage lasts ``COMPACTD_TEST_REDIS_OUTAGE_S`` seconds, a minute by default (issue 29's): the
worker's reconnect waits grow by 2 s a try, so after a minute it reconnects some seconds after
Redis is back, where after a shorter outage it would at once. The test checks the log lines the
RUNBOOK's "Redis down or restarted" quotes, and prints the appends' latency before and during
the outage.
"""

from __future__ import annotations

import asyncio
import logging
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from compactd.scheduler.client import BROKER_HOLD_S, CompactdClient
from compactd.storage.kinds import NodeKind
from compactd.worker.settings import load_config
from tests.support.db import Db
from tests.support.fake_provider import FakeProvider
from tests.support.private_redis import PrivateRedis
from tests.support.stack import Stack, wait_until
from tests.support.worker_stack import db

__all__ = ["db"]  # the fixture (tests/support/worker_stack.py)

OUTAGE_S = float(os.environ.get("COMPACTD_TEST_REDIS_OUTAGE_S", "60"))
SESSIONS = 4
TRIGGER_TOKENS = 3000
# Steps each session takes before the outage (under its trigger) and during it (over it by the
# outage's middle): a step is a user turn and an answer of about a hundred tokens each.
STEPS_BEFORE = 4
STEPS_DURING = 24
STEP_WORDS = 60


def turn(session: int, i: int) -> list[dict[str, str]]:
    words = " ".join(f"s{session}w{i}x{j}" for j in range(STEP_WORDS))
    return [{"role": "user", "content": f"step {i}: {words}"},
            {"role": "assistant", "content": f"done {i}: {words}"}]


@dataclass
class Appended:
    messages: dict[str, int] = field(default_factory=dict)
    signalled_during: set[str] = field(default_factory=set)
    signals: int = 0  # appends during the outage that signalled
    broker_down_at: float = 0.0
    before_ms: list[float] = field(default_factory=list)  # each append's time, before the outage
    during_ms: list[float] = field(default_factory=list)  # and during it


async def append_through_the_outage(stack: Stack, broker: PrivateRedis) -> Appended:
    """Append before and during the outage; close the client (its failed sends given up) before
    Redis comes back, so only the sweep can enqueue the sessions' runs."""
    out = Appended()
    async with CompactdClient(load_config(env=stack.env)) as client:
        handles = [await client.create_session(f"down-{k}", run_model="fake-gpt",
                                               context_window=128_000)
                   for k in range(SESSIONS)]
        for i in range(STEPS_BEFORE):
            for k, handle in enumerate(handles):
                started = time.perf_counter()
                step = await handle.append(turn(k, i))
                out.before_ms.append((time.perf_counter() - started) * 1000)
                assert not step.fired, "under the trigger before the outage"
        broker.stop()
        out.broker_down_at = time.monotonic()
        interval = OUTAGE_S / STEPS_DURING
        for i in range(STEPS_BEFORE, STEPS_BEFORE + STEPS_DURING):
            for k, handle in enumerate(handles):
                started = time.perf_counter()
                step = await handle.append(turn(k, i))
                out.during_ms.append((time.perf_counter() - started) * 1000)
                if step.signalled:
                    out.signalled_during.add(handle.id)
                    out.signals += 1
            await asyncio.sleep(max(0.0, out.broker_down_at + (i - STEPS_BEFORE + 1) * interval
                                    - time.monotonic()))
        for handle in handles:
            out.messages[handle.id] = handle.info.last_seq
    return out


def test_redis_down_for_a_while_loses_nothing_and_the_sweep_catches_up(
        clean_pg: str, fake: FakeProvider, db: Db, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    broker = PrivateRedis(tmp_path)
    broker.start()
    stack = Stack(clean_pg, broker.url, tmp_path / "stack", fake_url=fake.url,
                  summarization={"keep": {"type": "messages", "value": 6},
                                 "model_name": "fake-gpt", "lead": 0,
                                 "trigger": [{"type": "tokens", "value": TRIGGER_TOKENS}]},
                  worker={"sweep_interval_s": 1.0, "reap_interval_s": 1.0, "lease_s": 10})
    try:
        worker = stack.start_worker("w1", concurrency=4)
        beat = stack.start_beat()
        wait_until(lambda: "Sending due task" in stack.log("beat"), timeout=30,
                   what="beat to reach Redis before the outage")
        with caplog.at_level(logging.WARNING, logger="compactd.scheduler.client"):
            appended = asyncio.run(append_through_the_outage(stack, broker))
        # Every session crossed its trigger while Redis was down and kept signalling (a failed
        # or held-back send frees the mark); the runtime tried the broker once per hold, not
        # once per append, and logged each failure.
        assert appended.signalled_during == set(appended.messages), appended
        failures = [r for r in caplog.records if getattr(r, "action", None) == "signal_failed"]
        # (the first sends of the outage run together; after one fails, one per hold)
        assert 1 <= len(failures) <= SESSIONS + OUTAGE_S / BROKER_HOLD_S + 1, len(failures)
        assert appended.signals > 2 * len(failures), (appended.signals, len(failures))
        # What the RUNBOOK says the worker and beat log while Redis is down.
        assert "Connection to broker lost" in stack.log("w1")
        assert "Cannot connect to redis://" in stack.log("w1")
        assert "Trying again in " in stack.log("w1")
        assert "Couldn't apply scheduled task sweep: Error 111 connecting" in stack.log("beat")
        # The operator's view while Redis is down (status reads PostgreSQL only): no run
        # lately, and the sessions growing towards their window with their runway.
        status = stack.cli_json("status")
        assert status["recent"] == [] and status["leases"] == [], status
        assert {r["session"] for r in status["runway"]} == set(appended.messages), status
        assert worker.poll() is None, stack.log("w1")[-4000:]
        assert beat.poll() is None, stack.log("beat")[-4000:]
        for sid in appended.messages:
            assert not db.runs(sid), f"{sid}: nothing ran while Redis was down"
        left = appended.broker_down_at + OUTAGE_S - time.monotonic()
        if left > 0:
            time.sleep(left)

        broker.start()  # empty: nothing queued before the outage survives it
        for sid in appended.messages:
            wait_until(lambda: any(r.status == "committed" for r in db.runs(sid)),  # noqa: B023
                       timeout=60, what=f"{sid} to be compacted after Redis came back")
        for sid, last_seq in appended.messages.items():
            runs = db.runs(sid)
            assert [r.trigger for r in runs if r.status == "committed"] == ["sweep"], runs
            messages = db.events(sid, [NodeKind.MESSAGE])
            assert len(messages) == last_seq == 2 * (STEPS_BEFORE + STEPS_DURING), sid
            verified = db.verify(sid)
            assert verified.ok, verified.problems
        assert worker.poll() is None and beat.poll() is None
        assert stack.log("w1").count("Connected to redis") >= 2, "the worker reconnected"
        assert "Unrecoverable error" not in stack.log("w1")
        print(f"\nredis outage {OUTAGE_S:g} s: append median / max before "
              f"{statistics.median(appended.before_ms):.1f} / {max(appended.before_ms):.1f} ms "
              f"({len(appended.before_ms)}), during {statistics.median(appended.during_ms):.1f} / "
              f"{max(appended.during_ms):.1f} ms ({len(appended.during_ms)}); signal failures "
              f"logged {len(failures)} for {appended.signals} signalling appends")
    finally:
        stack.close()
        broker.stop()
