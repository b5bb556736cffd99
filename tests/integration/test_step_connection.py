"""The per-step statements on PostgreSQL (the runtime's append, poll and signal mark; a
worker's claim, surface read and commits) run on connections of the engine's pool: a refused or
cancelled statement leaves its connection usable, and one the server dropped is replaced,
without losing or doubling an append."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import asyncpg
import pytest

from storage.errors import DatabaseUnavailable, InvalidMessage, SessionNotFound
from storage.messages import parse_openai
from storage.store import Store
from tests.unit.compaction_helpers import user


@pytest.fixture
async def pg_store(clean_pg: str) -> AsyncIterator[Store]:
    store = Store.from_url(clean_pg)
    await store.create_session("s1", run_model="gpt-4o")
    try:
        yield store
    finally:
        await store.close()


async def terminate_all(url: str) -> int:
    """End every compactd connection to the database (the pool's); how many there were."""
    admin = await asyncpg.connect(url.replace("postgresql+asyncpg://", "postgresql://"))
    try:
        return len(await admin.fetch(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE datname = current_database() AND application_name = 'compactd'"))
    finally:
        await admin.close()


async def test_a_refused_statement_leaves_the_steps_running(pg_store: Store) -> None:
    await pg_store.append("s1", [user("a")])
    for i in range(3):
        result = await pg_store.append("s1", [user(f"b{i}")])
        assert await pg_store.poll("s1", result.session.surface_version) is None
    with pytest.raises(SessionNotFound):
        await pg_store.append("ghost", [user("x")])
    with pytest.raises(InvalidMessage, match="tool_call_id"):
        await pg_store.append("s1", [parse_openai(
            {"role": "tool", "tool_call_id": "never-made", "content": "x"})])
    with pytest.raises(SessionNotFound):
        await pg_store.poll("ghost", None)
    assert (await pg_store.append("s1", [user("c")])).last_seq == 5
    assert (await pg_store.get_session("s1")).last_seq == 5


async def test_a_connection_the_server_dropped_is_replaced(clean_pg: str,
                                                           pg_store: Store) -> None:
    await pg_store.append("s1", [user("a")])
    dropped = await terminate_all(clean_pg)
    assert dropped >= 1
    await asyncio.sleep(0.1)  # let the client's sockets see the close
    # A statement that meets a dead connection before its close is seen fails as unavailable
    # (an append's outcome would be unknown, so nothing is retried behind the caller's back),
    # and the connection is dropped from the pool: at most one failure per dead connection ...
    failures = 0
    for _ in range(dropped):
        try:
            await pg_store.poll("s1", None)
        except DatabaseUnavailable:
            failures += 1
    assert failures <= dropped
    # ... and from then on every statement runs on a new connection.
    for i in range(2 * dropped):
        assert (await pg_store.append("s1", [user(f"b{i}")])).last_seq == 2 + i
    assert (await pg_store.verify("s1")).ok


async def test_a_cancelled_append_lands_whole_or_not_at_all_and_the_connection_goes_on(
        pg_store: Store) -> None:
    big = [user("x" * 20_000) for _ in range(50)]
    for delay in (0.0, 0.001, 0.003, 0.01):
        task = asyncio.create_task(pg_store.append("s1", big))
        await asyncio.sleep(delay)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        # Whatever the cancellation interrupted, the next statements run normally (on the
        # same connection they wait until the server has ended the interrupted one), and the
        # cancelled append either landed whole or not at all: its caller cannot know which,
        # as with any statement cancelled in flight.
        after = await pg_store.append("s1", [user("next")])
        assert (after.last_seq - 1) % 50 == 0
        assert await pg_store.poll("s1", after.session.surface_version) is None
        # Back to a multiple of 50 for the next round's check.
        await pg_store.append("s1", [user("pad")] * 49)
    assert (await pg_store.verify("s1")).ok


async def test_concurrent_steps_share_the_pool(pg_store: Store) -> None:
    for i in range(5):
        await pg_store.create_session(f"c{i}", run_model="gpt-4o")
    results = await asyncio.gather(*(pg_store.append(f"c{i % 5}", [user(f"m{i}")])
                                     for i in range(40)))
    assert sorted(r.last_seq for r in results if r.session.id == "c0") == list(range(1, 9))
    for i in range(5):
        assert (await pg_store.get_session(f"c{i}")).last_seq == 8


async def test_a_pool_of_one_serves_statements_and_transactions(clean_pg: str) -> None:
    """A worker with ``db_pool_size: 1``: the single statements and the transactions share the
    pool's one connection, each giving it back when it ends."""
    store = Store.from_url(clean_pg, pool_size=1, max_overflow=0)

    async def steps() -> None:
        await store.create_session("s1", run_model="gpt-4o")
        assert (await store.append("s1", [user("a")])).last_seq == 1
        assert (await store.get_session("s1")).id == "s1"
        assert (await store.read_surface("s1")).seqs == [1]

    try:
        await asyncio.wait_for(steps(), 10)  # a starved pool would wait out its 30 s timeout
    finally:
        await store.close()
