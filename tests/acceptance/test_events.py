"""Events on the user's path: a runtime waits for a checkpoint with ``wait_for_checkpoint`` while a
real Celery worker compacts its session (real PostgreSQL and Redis, the fake provider over HTTP as
the summarizer); the wait is a LISTEN, and each commit and each failed run is a notification on
``compactd_events``."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import asyncpg
import pytest

from compactd.client import CompactdClient
from compactd.scheduler.samples import coding_session
from compactd.storage.kinds import FailureClass, RunStatus
from compactd.worker.settings import load_config
from tests.support.db import Db
from tests.support.fake_provider import Behaviour, FakeProvider
from tests.support.worker_stack import db

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.redis]
__all__ = ["db"]  # the fixture (tests/support/worker_stack.py)

# Automatic compaction never fires here: every run is one somebody asked for.
POLICY = {"trigger": [{"type": "tokens", "value": 10**9}],
          "keep": {"type": "messages", "value": 4}, "model_name": "fake-gpt",
          "trim_tokens_to_summarize": 100_000}


async def _heard(database_url: str) -> tuple[asyncpg.Connection, list[dict[str, Any]]]:
    """A connection of the test's own in LISTEN, and the events it hears."""
    conn = await asyncpg.connect(database_url)
    heard: list[dict[str, Any]] = []
    await conn.add_listener("compactd_events",
                            lambda *args: heard.append(json.loads(args[-1])))
    return conn, heard


def test_wait_for_checkpoint_returns_with_the_workers_commit(make_stack, fake: FakeProvider,
                                                             db: Db) -> None:  # type: ignore[no-untyped-def]
    stack = make_stack(summarization=POLICY)
    stack.ingest("s1", coding_session(steps=20, big_output_lines=30).messages)
    stack.start_worker("w1", concurrency=2)
    config = load_config(env=stack.env)

    async def wait() -> tuple[int | None, int | None, list[dict[str, Any]], int]:
        listening, heard = await _heard(stack.database_url)
        async with CompactdClient(config) as client:
            session = await client.get_session("s1")
            shown = len(await session.surface())
            before = session.version
            # Nothing commits: the wait ends at its timeout with None.
            idle = await session.wait_for_checkpoint(timeout_s=0.3)
            reads: list[str] = []
            fetchval = client.store.db.fetchval

            async def counted(name: str, **kw: Any) -> Any:
                reads.append(name)
                return await fetchval(name, **kw)

            client.store.db.fetchval = counted  # type: ignore[method-assign]
            waiting = asyncio.create_task(session.wait_for_checkpoint(timeout_s=60))
            await asyncio.sleep(0.2)
            await session.compact(wait=False)
            version = await waiting
            polls = reads.count("poll")
            surface = await session.surface()
            assert version is not None and version > before
            # The checkpoint the wait returned for: the surface is shorter than before.
            assert len(surface) < shown
        await asyncio.sleep(0.2)
        await listening.close()
        return idle, version, heard, polls

    idle, version, heard, polls = asyncio.run(wait())
    assert idle is None
    # One read of the version when the wait began, then only the notification: no polling.
    assert polls == 1
    [run] = db.runs("s1")
    assert run.status == RunStatus.COMMITTED
    committed = [e for e in heard if e["event"] == "compaction.committed"]
    assert committed, heard
    assert {e["session"] for e in committed} == {"s1"}
    assert all(e["tenant"] == "default" and e["run_id"] == run.id for e in committed)
    assert committed[-1]["version"] == db.session("s1").surface_version
    assert committed[-1]["outcome"] == RunStatus.COMMITTED
    assert version in {e["version"] for e in committed}


def test_a_failed_run_is_a_compaction_failed_event(make_stack, fake: FakeProvider,
                                                   db: Db) -> None:  # type: ignore[no-untyped-def]
    stack = make_stack(summarization=POLICY, worker={"local_fallback": False})
    stack.ingest("s1", coding_session(steps=20, big_output_lines=30).messages)
    stack.start_worker("w1", concurrency=2)
    fake.script(Behaviour(model="fake-gpt", status=400, times=-1))

    async def fail() -> list[dict[str, Any]]:
        listening, heard = await _heard(stack.database_url)
        await asyncio.to_thread(stack.cli, "compact", "s1", "--wait", check=False)
        await asyncio.sleep(0.3)
        await listening.close()
        return heard

    heard = asyncio.run(fail())
    [run] = db.runs("s1")
    assert run.status == RunStatus.FAILED and run.failure_class == FailureClass.SUMMARY
    [failed] = [e for e in heard if e["event"] == "compaction.failed"]
    assert failed["session"] == "s1" and failed["run_id"] == run.id
    assert failed["outcome"] == FailureClass.SUMMARY
