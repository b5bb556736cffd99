"""What a process must give back: the rate meter's slots of cancelled waiters (the shared Redis
meter the workers use, and the in-process one), and a runtime's process that imports the client
without the worker's app or kombu's global transport aliases changing under it."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest

from compactd.worker.keys import QUEUE_PRESSURE, RATE_PREFIX
from compactd.worker.limits import JITTER_MARGIN, LocalLimiter, RedisLimiter

RATE = 1.0
SLOT = (1 + JITTER_MARGIN) / RATE
NOW = 1_000_000.0


@pytest.fixture(params=["local", "redis"])
async def meter(request: pytest.FixtureRequest) -> AsyncIterator[tuple[Any, list[float]]]:
    """A limiter on a frozen clock: waits are exact slot multiples."""
    clock = [NOW]
    if request.param == "local":
        yield LocalLimiter(clock=lambda: clock[0]), clock
        return
    import redis.asyncio as aioredis

    client = aioredis.from_url(str(request.getfixturevalue("redis_url")))
    try:
        yield RedisLimiter(client, clock=lambda: clock[0]), clock
    finally:
        await client.aclose()


async def _reserved(limiter: Any, name: str) -> int:
    """How many slots the meter has handed out from the frozen clock's instant."""
    if isinstance(limiter, LocalLimiter):
        end = limiter._tat.get(name)
    else:
        raw = await limiter.redis.get(RATE_PREFIX + name)
        end = None if raw is None else float(raw)
    return 0 if end is None else round((end - NOW) / SLOT)


async def _waiting(limiter: Any, name: str, n: int) -> list[asyncio.Task[float]]:
    """``n`` more callers that have reserved their slots and sleep until them."""
    tasks = []
    for _ in range(n):
        before = await _reserved(limiter, name)
        tasks.append(asyncio.create_task(limiter.acquire(name, RATE)))
        while await _reserved(limiter, name) == before:
            await asyncio.sleep(0.001)
    return tasks


async def _cancel(tasks: list[asyncio.Task[float]]) -> None:
    for task in tasks:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_cancelled_waiters_give_their_slots_back(meter: tuple[Any, list[float]]) -> None:
    limiter, _clock = meter
    name = f"test:{uuid.uuid4().hex}"
    assert await limiter.acquire(name, RATE) == 0.0
    waiting = await _waiting(limiter, name, 3)
    # Cancelled in the order they reserved: the first two are not at the schedule's end when
    # they give up, the last one is and takes the others' freed slots back with it.
    await _cancel(waiting)
    assert await limiter.acquire(name, RATE) == pytest.approx(SLOT, abs=1e-6)


async def test_a_slot_freed_before_one_still_held_is_not_given_twice(
        meter: tuple[Any, list[float]]) -> None:
    limiter, _clock = meter
    name = f"test:{uuid.uuid4().hex}"
    assert await limiter.acquire(name, RATE) == 0.0
    first, second = await _waiting(limiter, name, 2)
    await _cancel([first])
    # The second caller still holds the slot after the freed one: a newcomer goes after it.
    [newcomer] = await _waiting(limiter, name, 1)
    assert await _reserved(limiter, name) == 4
    await _cancel([second, newcomer])
    # Both later slots are freed now, so the schedule is back to one slot after the first call.
    assert await limiter.acquire(name, RATE) == pytest.approx(SLOT, abs=1e-6)


_IMPORT_PROBE = """
import json, sys
import kombu.transport
aliases = dict(kombu.transport.TRANSPORT_ALIASES)
import compactd.scheduler.client
imported = {"compactd.worker.app": "compactd.worker.app" in sys.modules,
            "celery": "celery" in sys.modules,
            "aliases_kept": dict(kombu.transport.TRANSPORT_ALIASES) == aliases}
from compactd.worker.enqueue import RunRequest
client = compactd.scheduler.client.CompactdClient()
task_id = client.enqueuer.send(RunRequest("probe", "pressure"))
from celery import current_app
print(json.dumps({**imported, "task_id": task_id,
                  "aliases_kept_after_send": dict(kombu.transport.TRANSPORT_ALIASES) == aliases,
                  "tasks_imported": "compactd.worker.tasks" in sys.modules,
                  "current_app": current_app.main}))
"""


def test_the_client_leaves_the_runtimes_process_alone(clean_redis: str, tmp_path: Any,
                                                      cli_env: dict[str, str]) -> None:
    """A runtime imports the client and enqueues through it: the worker's app is never built,
    kombu's transport aliases (which the runtime's own Celery or kombu use) are not rewritten,
    and the message reaches the broker."""
    import redis

    env = {**cli_env, "COMPACTD_BROKER_URL": clean_redis,
           "COMPACTD_DATABASE_URL": f"sqlite:///{tmp_path / 'c.sqlite3'}"}
    out = subprocess.run([sys.executable, "-c", _IMPORT_PROBE], env=env, capture_output=True,
                         text=True, timeout=60, check=True)
    probe = json.loads(out.stdout.strip().splitlines()[-1])
    assert probe["compactd.worker.app"] is False and probe["celery"] is False
    assert probe["aliases_kept"] and probe["aliases_kept_after_send"]
    assert probe["tasks_imported"] is False and probe["current_app"] != "compactd"
    queued = redis.Redis.from_url(clean_redis).lrange(QUEUE_PRESSURE, 0, -1)
    assert [json.loads(m)["headers"]["id"] for m in queued] == [probe["task_id"]]
