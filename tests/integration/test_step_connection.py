"""The connections a PostgreSQL store keeps for the statements it runs over and over (the
runtime's append, poll and signal mark; a worker's claim, surface read and commits): reused,
left in place by a refused or cancelled statement, and replaced when it fails, without losing or
doubling an append."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import asyncpg
import pytest

from compactd.storage.errors import DatabaseUnavailable, InvalidMessage, SessionNotFound
from compactd.storage.messages import parse_openai
from compactd.storage.store import Store
from tests.support.surfaces import user


@pytest.fixture
async def pg_store(clean_pg: str) -> AsyncIterator[Store]:
    store = Store.from_url(clean_pg)
    await store.create_session("s1", run_model="gpt-4o")
    try:
        yield store
    finally:
        await store.close()


async def step_backend(store: Store) -> int:
    """The server process behind the store's kept connection."""
    async with store.db._kept.use() as raw:  # type: ignore[attr-defined]
        return int(await raw.fetchval("SELECT pg_backend_pid()"))


async def terminate(url: str, pid: int) -> None:
    admin = await asyncpg.connect(url.replace("postgresql+asyncpg://", "postgresql://"))
    try:
        assert await admin.fetchval("SELECT pg_terminate_backend($1)", pid)
    finally:
        await admin.close()


async def test_steps_reuse_one_connection_and_a_refused_statement_keeps_it(
        pg_store: Store) -> None:
    await pg_store.append("s1", [user("a")])
    pid = await step_backend(pg_store)
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
    assert await step_backend(pg_store) == pid
    assert (await pg_store.get_session("s1")).last_seq == 4


async def test_a_connection_the_server_dropped_is_replaced(clean_pg: str,
                                                           pg_store: Store) -> None:
    await pg_store.append("s1", [user("a")])
    await terminate(clean_pg, await step_backend(pg_store))
    await asyncio.sleep(0.1)  # let the client's socket see the close
    # A statement that meets the dead connection before its close is seen fails as
    # unavailable (an append's outcome would be unknown, so nothing is retried behind the
    # caller's back) ...
    with contextlib.suppress(DatabaseUnavailable):
        await pg_store.poll("s1", None)
    # ... and the next one runs on a new connection.
    result = await pg_store.append("s1", [user("b")])
    assert result.last_seq == 2
    assert (await pg_store.verify("s1")).ok


async def test_a_write_in_a_read_only_session_is_retryable_and_its_connection_replaced(
        pg_store: Store) -> None:
    """SQLSTATE 25006 is what a demoted primary or a hot standby answers a write with after a
    failover: retryable like a lost connection, never a hard failure, and the connection that
    met it is not handed out again (a new one finds the writable server)."""
    await pg_store.append("s1", [user("a")])
    pid = await step_backend(pg_store)
    async with pg_store.db._kept.use() as raw:  # type: ignore[attr-defined]
        await raw.execute("SET SESSION CHARACTERISTICS AS TRANSACTION READ ONLY")
    with pytest.raises(DatabaseUnavailable) as refused:
        await pg_store.append("s1", [user("b")])
    assert refused.value.retryable and "25006" in str(refused.value)
    result = await pg_store.append("s1", [user("b")])
    assert result.last_seq == 2 and await step_backend(pg_store) != pid
    assert (await pg_store.verify("s1")).ok


async def test_a_cancelled_append_lands_whole_or_not_at_all_and_the_connection_goes_on(
        pg_store: Store) -> None:
    big = [user("x" * 20_000) for _ in range(50)]
    pid = await step_backend(pg_store)
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
    assert await step_backend(pg_store) == pid


async def test_concurrent_steps_share_the_pool_when_the_kept_connection_is_busy(
        pg_store: Store) -> None:
    for i in range(5):
        await pg_store.create_session(f"c{i}", run_model="gpt-4o")
    results = await asyncio.gather(*(pg_store.append(f"c{i % 5}", [user(f"m{i}")])
                                     for i in range(40)))
    assert sorted(r.last_seq for r in results if r.session.id == "c0") == list(range(1, 9))
    for i in range(5):
        assert (await pg_store.get_session(f"c{i}")).last_seq == 8


async def test_a_store_keeps_at_most_its_capacity_and_reuses_those(clean_pg: str) -> None:
    """A worker's store keeps several connections: uses beyond them go through the pool, and
    the kept ones serve the later statements."""
    store = Store.from_url(clean_pg, kept_connections=3)
    try:
        async def burst(size: int) -> set[int]:
            gate = asyncio.Event()
            pids: list[int] = []

            async def hold() -> None:
                async with store.db._kept.use() as raw:
                    pids.append(int(await raw.fetchval("SELECT pg_backend_pid()")))
                    await gate.wait()

            tasks = [asyncio.create_task(hold()) for _ in range(size)]
            while len(pids) < size:
                await asyncio.sleep(0.01)
            gate.set()
            await asyncio.gather(*tasks)
            return set(pids)

        first = await burst(5)
        assert len(first) == 5  # three kept, two from the pool at once
        assert store.db._kept._held == 3 and len(store.db._kept._idle) == 3
        again = await burst(3)
        assert len(again) == 3 and again <= first
        assert store.db._kept._held == 3
    finally:
        await store.close()
    assert store.db._kept._held == 0


async def test_a_close_while_a_connection_is_being_taken_leaves_none_kept(clean_pg: str) -> None:
    """A connection that was still connecting when the store closed is stale too: it goes back
    to the pool when its statement ends instead of staying checked out after close()."""
    store = Store.from_url(clean_pg, kept_connections=2)
    try:
        async def statement() -> int:
            async with store.db._kept.use() as raw:
                return int(await raw.fetchval("SELECT 1"))

        task = asyncio.create_task(statement())
        await asyncio.sleep(0)  # the task is inside the pool's connect now
        assert store.db._kept._held == 1 and not store.db._kept._idle
        await store.db._kept.close()
        assert await task == 1
        assert store.db._kept._held == 0 and not store.db._kept._idle
    finally:
        await store.close()


async def test_a_pool_of_one_with_nothing_kept_serves_statements_and_transactions(
        clean_pg: str) -> None:
    """A worker with ``db_pool_size: 1`` keeps no connection (capacity 0): the kept statements
    and the transactions share the pool's one connection instead of the transactions waiting
    for a connection a kept statement holds."""
    store = Store.from_url(clean_pg, pool_size=1, max_overflow=0, kept_connections=0)

    async def steps() -> None:
        await store.create_session("s1", run_model="gpt-4o")
        assert (await store.append("s1", [user("a")])).last_seq == 1
        assert (await store.get_session("s1")).id == "s1"
        assert (await store.read_surface("s1")).seqs == [1]

    try:
        await asyncio.wait_for(steps(), 10)  # a starved pool would wait out its 30 s timeout
        assert store.db._kept._held == 0
    finally:
        await store.close()
