"""``Store.wait_for_version`` on both backends: a commit from another store (another pool, as a
worker is another process) ends the wait with the new version; a refused commit does not; with
nothing committed the wait ends at its timeout. On PostgreSQL the commit, the failed run's end
and a published event are notifications on ``compactd_events``."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from compactd.storage.errors import SessionNotFound, SurfaceChanged
from compactd.storage.events import CHANNEL, Event, EventKind, commit_event, run_end_event
from compactd.storage.kinds import NodeKind
from compactd.storage.records import Claim, Replacement, RunEnd, SessionInfo
from compactd.storage.store import Store
from tests.support.surfaces import user


def checkpoint(seqs: tuple[int, ...]) -> Replacement:
    return Replacement(seqs=seqs, kind=NodeKind.CHECKPOINT, tokens=3,
                       payload={"role": "user", "content": "summary",
                                "meta": {"checkpoint": True, "summary": "summary"}},
                       journal_kind="compaction/summary", journal={"text": "summary"})


async def claimed(store: Store) -> Claim:
    claim = await store.claim("s1", owner="w1", trigger="manual", lease_s=30)
    assert isinstance(claim, Claim)
    return claim


async def test_a_commit_elsewhere_ends_the_wait_with_its_version(db_url: str) -> None:
    waiter, committer = Store.from_url(db_url), Store.from_url(db_url)
    try:
        await waiter.create_session("s1", tenant="acme")
        appended = await waiter.append("s1", [user(f"m{i}") for i in range(6)])
        with pytest.raises(SessionNotFound):
            await waiter.wait_for_version("nope", 0, 0.1)
        assert await waiter.wait_for_version("s1", appended.version, 0.2) is None
        # A version already past is answered at once.
        assert await waiter.wait_for_version("s1", 0, 5) == appended.version

        waiting = asyncio.create_task(waiter.wait_for_version("s1", appended.version, 10))
        await asyncio.sleep(0.1)
        claim = await claimed(committer)
        with pytest.raises(SurfaceChanged):
            await committer.commit("s1", run_id=claim.run_id, fence=claim.fence,
                                   replacements=[checkpoint((1, 2))], expected=[(0, 2)])
        await asyncio.sleep(0.2)
        assert not waiting.done(), "a refused commit woke the waiter"
        info = await committer.commit("s1", run_id=claim.run_id, fence=claim.fence,
                                      replacements=[checkpoint((1, 2))],
                                      end=RunEnd(outcome="committed"))
        assert await asyncio.wait_for(waiting, 5) == info.surface_version > appended.version
    finally:
        await waiter.close()
        await committer.close()


@contextlib.asynccontextmanager
async def listening(store: Store) -> AsyncIterator[list[dict[str, Any]]]:
    """The events heard on the channel while the block runs (a connection of the store's pool
    in LISTEN)."""
    heard: list[dict[str, Any]] = []

    def hear(*args: Any) -> None:
        heard.append(json.loads(args[-1]))

    async with store.engine.connect() as conn:
        raw: Any = (await conn.get_raw_connection()).driver_connection
        await raw.add_listener(CHANNEL, hear)
        try:
            yield heard
        finally:
            await raw.remove_listener(CHANNEL, hear)
            await conn.invalidate()


async def committed_once(store: Store) -> tuple[Claim, SessionInfo]:
    """Session s1 of tenant acme, claimed, and its first two messages checkpointed."""
    await store.create_session("s1", tenant="acme")
    await store.append("s1", [user(f"m{i}") for i in range(6)])
    claim = await claimed(store)
    info = await store.commit("s1", run_id=claim.run_id, fence=claim.fence,
                              replacements=[checkpoint((1, 2))])
    return claim, info


async def until_heard(heard: list[dict[str, Any]], count: int) -> None:
    for _ in range(200):
        if len(heard) >= count:
            return
        await asyncio.sleep(0.01)


@pytest.mark.postgres
async def test_commits_failed_ends_and_published_events_are_notifications(
        clean_pg: str) -> None:
    store = Store.from_url(clean_pg)
    try:
        async with listening(store) as heard:
            claim, info = await committed_once(store)
            assert await store.finish("s1", run_id=claim.run_id, fence=claim.fence,
                                      end=RunEnd(outcome="failed", failure_class="summary"))
            await store.publish(Event(EventKind.OVERFLOW_SERVED, "s1", "acme", claim.run_id,
                                      info.surface_version))
            await until_heard(heard, 3)
    finally:
        await store.close()
    base = {"session": "s1", "tenant": "acme", "run_id": claim.run_id}
    assert heard == [
        {**base, "event": "compaction.committed", "version": info.surface_version,
         "seq": info.last_seq, "outcome": "running"},
        {**base, "event": "compaction.failed", "version": info.surface_version,
         "seq": info.last_seq + 1, "outcome": "summary"},
        {**base, "event": "session.overflow_served", "version": info.surface_version,
         "seq": None, "outcome": None}]


@pytest.mark.postgres
async def test_a_commits_notification_is_the_event_storage_events_builds(clean_pg: str) -> None:
    """The commit's statement sends its event (queries.sql); storage.events builds it for
    everything else (webhooks, a run's end): a commit, and one that ends its run, are heard
    as exactly the events Python builds for them."""
    store = Store.from_url(clean_pg)
    try:
        async with listening(store) as heard:
            claim, running = await committed_once(store)
            ended = await store.commit("s1", run_id=claim.run_id, fence=claim.fence,
                                       replacements=[checkpoint((3, 4))],
                                       end=RunEnd(outcome="committed"))
            await until_heard(heard, 2)
    finally:
        await store.close()
    assert heard == [
        commit_event("s1", "acme", claim.run_id, version=running.surface_version,
                     seq=running.last_seq, outcome="running").to_json(),
        run_end_event("s1", "acme", claim.run_id, version=ended.surface_version,
                      seq=ended.last_seq, status="committed", failure_class=None).to_json()]
