"""A deadline bounds the store's statements on both backends: a lock wait ends when it passes,
the connection stays usable, and past it a statement is refused before it is sent."""

from __future__ import annotations

import asyncio

import pytest

from compactd.storage.database import deadline
from compactd.storage.errors import DeadlinePassed, LockNotAvailable
from compactd.storage.messages import parse_openai
from compactd.storage.store import Store
from tests.support.locks import session_row_locked

# Far longer than the deadlines below: a wait that is not bounded shows as this timeout.
UNBOUNDED_S = 20.0


async def test_a_deadline_ends_a_lock_wait_and_the_store_goes_on(store: Store,
                                                                 db_url: str) -> None:
    await store.create_session("s1")
    await store.append("s1", [parse_openai({"role": "user", "content": "hello"})])
    claim = await store.claim("s1", owner="w1", trigger="manual", lease_s=30)
    loop = asyncio.get_running_loop()
    expected = LockNotAvailable if db_url.startswith("sqlite") else DeadlinePassed
    async with session_row_locked(db_url, "s1"):
        with deadline(loop.time() + 0.5), pytest.raises(expected):
            await asyncio.wait_for(store.renew("s1", run_id=claim.run_id, fence=claim.fence,
                                               lease_s=30), UNBOUNDED_S)
    # The same pool serves on, and the lock wait left nothing behind.
    with deadline(loop.time() + UNBOUNDED_S):
        assert await store.renew("s1", run_id=claim.run_id, fence=claim.fence, lease_s=30)
        assert [n.seq for n in (await store.read_surface("s1")).nodes] == [1]
    # Past its deadline, a write is refused before it reaches the database.
    with deadline(loop.time() - 1), pytest.raises(DeadlinePassed):
        await store.renew("s1", run_id=claim.run_id, fence=claim.fence, lease_s=30)
