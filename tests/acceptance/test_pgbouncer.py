"""compactd behind PgBouncer in transaction pooling mode (what ops/RUNBOOK.md recommends), on the
user's path: a client appends and polls through the pooler, a real ``celery -A
compactd.worker.app worker`` (through the same pooler) compacts the run the trigger queued, and
``history_search`` finds a message the compaction replaced. The pooler is Debian's pgbouncer,
started by the test on a port of its own (tests/support/pgbouncer.py), with fewer server
connections than the processes open client connections, so statements of one client
connection run on several server connections.

Without ``database.statement_cache: false`` asyncpg prepares statements by name on a server
connection that the next transaction may not get: the last test shows that error.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx
import pytest

from compactd.scheduler.client import CompactdClient
from compactd.scheduler.samples import coding_session
from compactd.storage.errors import CompactdError
from compactd.storage.messages import parse_openai
from compactd.storage.migrate import HEAD_REVISION, upgrade
from compactd.worker.enqueue import RunRequest
from compactd.worker.runtime import build_deps
from compactd.worker.settings import Config, Settings, build_config
from tests.support.api import TOKEN_A, bearer, start_api
from tests.support.db import Db
from tests.support.fake_provider import Behaviour, FakeProvider
from tests.support.pgbouncer import PgBouncer
from tests.support.recall_sample import NEEDLE, needle_messages
from tests.support.services import create_database_sync, drop_database_sync, with_database
from tests.support.stack import Stack, wait_until
from tests.support.stack_sessions import config_of
from tests.support.worker_stack import db, enqueuer

pytestmark = pytest.mark.slow
__all__ = ["db"]  # the fixture (tests/support/worker_stack.py)

POLICY = {"trigger": [{"type": "tokens", "value": 20_000}],
          "keep": {"type": "messages", "value": 12}, "model_name": "fake-gpt"}
BEHIND_POOLER = {"database": {"statement_cache": False}}


@pytest.fixture
def bouncer(clean_pg: str) -> Iterator[PgBouncer]:
    # Four server connections for a worker's pool of twenty and a client's five.
    with PgBouncer(clean_pg, pool_mode="transaction", pool_size=4) as pooler:
        yield pooler


@pytest.mark.timeout(180)
async def test_append_poll_a_queued_compaction_and_recall_through_pgbouncer(
        bouncer: PgBouncer, clean_redis: str, tmp_path: Path, fake: FakeProvider) -> None:
    with Stack(bouncer.url, clean_redis, tmp_path / "stack", fake_url=fake.url,
               summarization=POLICY, extra_config=BEHIND_POOLER) as stack:
        config = config_of(stack)
        assert config.database_url == bouncer.url and not config.database.statement_cache
        async with CompactdClient(config) as client:
            handle = await client.create_session("pooled", run_model="fake-gpt")
            sample = needle_messages()
            appended_at = 0
            fired = False
            for message in sample:
                step = await handle.append([message])
                appended_at = step.version
                fired = fired or step.fired
            assert fired, "the appends never crossed the trigger"
            # The worker starts once the session is whole and takes the run the trigger queued:
            # started first, on a loaded machine it compacted between appends, and the needle
            # stayed in the tail that run kept (the session then stayed under its trigger).
            stack.start_worker("w1", concurrency=4)
            # A first run may only prune (the needle's tool result stays); the trigger still
            # holds, so another follows with a summary that replaces it.
            surface = await _poll_until_replaced(handle, appended_at, timeout_s=120)
            assert len(surface) < len(sample)
            # The worker indexes what a run replaced right after its commit.
            found = await _search_until_found(handle, timeout_s=60)
            assert found.hits and found.hits[0].exact and NEEDLE in found.hits[0].snippet
        assert "Traceback" not in stack.log("w1"), stack.log("w1")[-3000:]
        assert "prepared statement" not in bouncer.log()


@pytest.mark.timeout(180)
def test_the_http_api_through_pgbouncer(bouncer: PgBouncer, clean_redis: str, tmp_path: Path,
                                        fake: FakeProvider) -> None:
    """A runtime in another language: ``compactd serve`` through the pooler, its appends
    queue the compaction a worker (through the pooler) runs, and its recall route finds the
    replaced message."""
    with Stack(bouncer.url, clean_redis, tmp_path / "stack", fake_url=fake.url,
               summarization=POLICY, extra_config=BEHIND_POOLER) as stack:
        url = start_api(stack)
        stack.start_worker("w1", concurrency=4)
        api = f"{url}/v1/sessions/web"
        with httpx.Client(headers=bearer(TOKEN_A), timeout=60) as http:
            http.put(api, json={"run_model": "fake-gpt"}).raise_for_status()
            for message in needle_messages():
                http.post(f"{api}/messages", json={"messages": [message]}).raise_for_status()
            # The surface's version moves when the compaction commits; wait for the one
            # that replaced the needle, then for the index of what it replaced.
            wait_until(lambda: NEEDLE not in http.get(f"{api}/surface").text, timeout=120,
                       what="a compaction to replace the needle")
            hits = wait_until(lambda: http.get(f"{api}/history/search",
                                               params={"query": NEEDLE}).json()["hits"],
                              timeout=60, what="history_search to find the needle")
            assert hits[0]["exact"] and NEEDLE in hits[0]["snippet"]
        assert "Traceback" not in stack.log("api") + stack.log("w1")


async def _poll_until_replaced(handle: Any, since: int, *, timeout_s: float
                               ) -> list[dict[str, Any]]:
    """What a runtime does between steps: poll, and read the surface when a compaction's commit
    moved it, until one replaced the needle's message."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        moved = await handle.poll(since)
        if moved is not None:
            since = moved
            surface: list[dict[str, Any]] = await handle.surface()
            if NEEDLE not in str(surface):
                return surface
        if loop.time() >= deadline:
            raise AssertionError(f"no compaction replaced the needle within {timeout_s:g} s")
        await asyncio.sleep(0.2)


async def _search_until_found(handle: Any, *, timeout_s: float) -> Any:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        found = await handle.history_search(NEEDLE)
        if found.hits or loop.time() >= deadline:
            return found
        await asyncio.sleep(0.2)


@pytest.mark.timed
@pytest.mark.timeout(180)
def test_the_cli_and_a_workers_start_follow_the_setting_through_one_use_server_connections(
        clean_pg: str, clean_redis: str, tmp_path: Path, fake: FakeProvider, db: Db) -> None:
    """Behind a pooler that closes each server connection after one transaction, a statement
    prepared by name is gone at its second use: every store compactd opens must read the
    setting. The CLI's (ingest, status, an inline run's) and the one a worker opens at its
    start to release the leases of this host's dead workers (one statement per lease), beside
    the worker's own."""
    sessions = ("k1", "k2")
    fake.script(Behaviour(model="fake-gpt", hang=True, times=len(sessions)))
    with PgBouncer(clean_pg, pool_mode="transaction", pool_size=4, server_lifetime=0) as pooler, \
            Stack(pooler.url, clean_redis, tmp_path / "stack", fake_url=fake.url,
                  summarization=POLICY, extra_config=BEHIND_POOLER) as stack:
        # One through the CLI, the other straight into the database (the CLI's is the slow path
        # here: a server connection for each of its transactions).
        stack.ingest("k1", coding_session(steps=20, big_output_lines=30, seed=900).messages)
        db.ingest("k2", coding_session(steps=20, big_output_lines=30, seed=901).messages)
        stack.start_worker("w1", concurrency=2)
        with enqueuer(stack) as enq:
            for sid in sessions:
                enq.send(RunRequest(sid, "manual"))
        wait_until(lambda: len(fake.requests_for(model="fake-gpt")) == len(sessions),
                   timeout=30, what="both summary calls")
        stack.kill("w1")
        # Their leases (the default length) would hold the sessions until the reaper came.
        stack.start_worker("w2", concurrency=2)
        wait_until(lambda: all(db.session(sid).lease_run_id is None for sid in sessions),
                   timeout=20, what="the dead worker's leases released at the new worker's start")
        status = stack.cli_json("status", "k1")
        assert status["runs"][0]["failure_class"] == "abandoned", status["runs"]
        inline = stack.cli_json("compact", "k1", "--inline")
        assert inline["outcome"] == "committed", inline


def _pooled_config(pooler: PgBouncer, home: Path, *, statement_cache: bool) -> Config:
    settings = Settings(database_url=pooler.url, broker_url="memory://", home=str(home))
    return build_config({"database": {"statement_cache": statement_cache}}, settings=settings)


async def test_without_the_setting_a_statement_prepared_on_one_server_fails_on_another(
        clean_pg: str, tmp_path: Path) -> None:
    """The setting is what makes the path above work. With asyncpg's statement cache on, the
    client's second append reuses the statement its first prepared by name on the server
    connection it had then; once PgBouncer has replaced that one (as it does when
    server_lifetime ends, here at once with its RECONNECT), the append runs on a server
    connection where no such statement exists, and fails. With the setting off the same
    sequence appends."""
    messages = needle_messages()[:4]
    with PgBouncer(clean_pg, pool_mode="transaction", pool_size=2) as pooler:
        for statement_cache in (True, False):
            config = _pooled_config(pooler, tmp_path, statement_cache=statement_cache)
            async with CompactdClient(config) as client:
                handle = await client.create_session(f"s-{statement_cache}")
                await handle.append(messages[:2])
                await pooler.admin(f"RECONNECT {pooler.database}")
                if statement_cache:
                    with pytest.raises(CompactdError, match="SQLSTATE 26000"):
                        await handle.append(messages[2:])
                else:
                    step = await handle.append(messages[2:])
                    assert step.last_seq == len(messages)


async def test_a_workers_statements_follow_the_setting_too(clean_pg: str, tmp_path: Path
                                                           ) -> None:
    """The same sequence on a worker process's store (``build_deps`` as its tasks call it): a
    worker reads the setting where it opens its connections, not only the client."""
    messages = [parse_openai(m) for m in needle_messages()[:4]]
    with PgBouncer(clean_pg, pool_mode="transaction", pool_size=2) as pooler:
        for statement_cache in (False, True):
            config = _pooled_config(pooler, tmp_path, statement_cache=statement_cache)
            deps = await build_deps(config, owner="w")
            try:
                sid = f"w-{statement_cache}"
                await deps.store.create_session(sid)
                await deps.store.append(sid, messages[:2])
                await pooler.admin(f"RECONNECT {pooler.database}")
                if statement_cache:
                    with pytest.raises(CompactdError, match="SQLSTATE 26000"):
                        await deps.store.append(sid, messages[2:])
                else:
                    step = await deps.store.append(sid, messages[2:])
                    assert step.session.last_seq == len(messages)
            finally:
                await deps.aclose()


def test_compactd_migrate_runs_through_pgbouncer(pg_url: str) -> None:
    """What the RUNBOOK says a release may do: run ``compactd migrate`` through the pooler
    (its revisions each in a transaction, its concurrent index builds in autocommit): a new
    database migrated to head, then migrated again (a no-op)."""
    url = with_database(pg_url, urlparse(pg_url).path.lstrip("/") + "_pgbouncer")
    drop_database_sync(url)
    create_database_sync(url)
    try:
        with PgBouncer(url, pool_mode="transaction", pool_size=2) as pooler:
            upgrade(pooler.url)
            upgrade(pooler.url)
        assert asyncio.run(_revision(url)) == HEAD_REVISION
    finally:
        drop_database_sync(url)


async def _revision(url: str) -> str:
    import asyncpg

    conn = await asyncpg.connect(url)
    try:
        return str(await conn.fetchval("SELECT version_num FROM alembic_version"))
    finally:
        await conn.close()
