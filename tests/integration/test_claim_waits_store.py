"""A claim waits for a session row another short transaction holds, on both backends, and a
wait the run's deadline ends is the deadline's: no ``busy`` run is recorded for either. The
worker path is ``tests/acceptance/test_claim_waits.py``."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from compactd.storage.database import deadline
from compactd.storage.errors import DeadlinePassed, LockNotAvailable
from compactd.storage.messages import parse_openai
from compactd.storage.records import Claim
from compactd.storage.store import Store
from tests.support.locks import session_row_locked


@contextlib.asynccontextmanager
async def held_for(db_url: str, session_id: str, seconds: float) -> AsyncIterator[None]:
    """Another connection holds the session's row (the write lock on SQLite) for ``seconds``,
    from before the block starts."""
    held = asyncio.Event()

    async def hold() -> None:
        async with session_row_locked(db_url, session_id):
            held.set()
            await asyncio.sleep(seconds)

    task = asyncio.create_task(hold())
    await held.wait()
    try:
        yield
    finally:
        await task


async def seeded(store: Store) -> None:
    await store.create_session("s1")
    await store.append("s1", [parse_openai({"role": "user", "content": "hello"})])


async def test_a_claim_waits_for_a_short_transaction(store: Store, db_url: str) -> None:
    await seeded(store)
    async with held_for(db_url, "s1", 0.2):
        claim = await store.claim("s1", owner="w1", trigger="pressure", lease_s=30)
    assert isinstance(claim, Claim)
    assert [(r.status, r.failure_class) for r in await store.session_runs("s1")] == [
        ("running", None)]


async def test_a_claim_whose_deadline_ends_the_wait_records_no_busy_run(store: Store,
                                                                        db_url: str) -> None:
    await seeded(store)
    loop = asyncio.get_running_loop()
    expected = LockNotAvailable if db_url.startswith("sqlite") else DeadlinePassed
    async with held_for(db_url, "s1", 1.0):
        with deadline(loop.time() + 0.3), pytest.raises(expected):
            await store.claim("s1", owner="w1", trigger="pressure", lease_s=30)
    assert await store.session_runs("s1") == []
    info = await store.get_session("s1")
    assert info.lease_run_id is None
    # The row is free again: the next claim takes it.
    assert isinstance(await store.claim("s1", owner="w1", trigger="pressure", lease_s=30), Claim)
