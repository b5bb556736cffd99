"""The manual-run mark on both databases: one queued manual task per session until it starts."""

from __future__ import annotations

import asyncio
import datetime as dt

import pytest

from compactd.storage.errors import SessionNotFound
from compactd.storage.store import Store

NOW = dt.datetime(2026, 12, 1, 12, 0, tzinfo=dt.UTC)


async def test_a_live_mark_answers_with_its_task_until_cleared_or_stale(store: Store) -> None:
    await store.create_session("s1")
    await store.create_session("s2")
    assert await store.mark_manual("s1", "t1", ttl_s=120, now=NOW) == "t1"
    assert await store.mark_manual("s1", "t2", ttl_s=120, now=NOW) == "t1"
    assert await store.mark_manual("s2", "t3", ttl_s=120, now=NOW) == "t3"
    # Another task's clear leaves the mark; its own frees it.
    await store.clear_manual("s1", "t2")
    assert await store.mark_manual("s1", "t4", ttl_s=120, now=NOW) == "t1"
    await store.clear_manual("s1", "t1")
    assert await store.mark_manual("s1", "t4", ttl_s=120, now=NOW) == "t4"
    # A mark older than the TTL (its message lost) is taken over.
    later = NOW + dt.timedelta(seconds=121)
    assert await store.mark_manual("s1", "t5", ttl_s=120, now=later) == "t5"
    assert await store.mark_manual("s2", "t6", ttl_s=120, now=NOW) == "t3"


async def test_racing_requests_agree_on_one_task(store: Store) -> None:
    await store.create_session("s1")
    held = await asyncio.gather(*(store.mark_manual("s1", f"t{i}", ttl_s=120)
                                  for i in range(10)))
    assert len(set(held)) == 1


async def test_a_missing_session_is_not_found(store: Store) -> None:
    with pytest.raises(SessionNotFound):
        await store.mark_manual("nope", "t1", ttl_s=120)
