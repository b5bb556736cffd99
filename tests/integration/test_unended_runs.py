"""A run whose end the database could not take (worker.run.UnendedRuns), on the real database:
its end is written again every ``retry_s`` until it lands or the lease expires; a failure that
is not the database's reachability is logged once, and again only when it changes."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import asyncpg
import pytest

from compactd.storage.errors import LockNotAvailable, SchemaMissing
from compactd.storage.kinds import FailureClass, RunCause, RunStatus
from compactd.storage.records import Claim, RunEnd
from compactd.storage.store import Store
from compactd.worker.limits import LocalLimiter
from compactd.worker.run import UnendedRuns
from compactd.worker.runtime import Deps
from compactd.worker.settings import Settings, build_config


async def test_a_failure_to_end_a_run_is_logged_once_and_again_when_it_changes(
        store: Store, db_url: str, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    config = build_config({}, settings=Settings(database_url=db_url, broker_url="memory://"))
    deps = Deps(config=config, store=store, limiter=LocalLimiter(), owner="w1")
    await store.create_session("s1")
    claim = await store.claim("s1", owner="w1", trigger=RunCause.PRESSURE, lease_s=600)
    assert isinstance(claim, Claim)
    # The write fails twelve times with one error, then four with another, then lands.
    failures: list[Exception] = [SchemaMissing()] * 12 + [LockNotAvailable()] * 4
    finish = store.finish

    async def failing_finish(*args: Any, **kwargs: Any) -> bool:
        if failures:
            raise failures.pop(0)
        return await finish(*args, **kwargs)

    monkeypatch.setattr(store, "finish", failing_finish)
    unended = UnendedRuns(deps, retry_s=0.01)
    with caplog.at_level(logging.WARNING, logger="compactd"):
        unended.add(claim, RunEnd(outcome=RunStatus.FAILED,
                                  failure_class=FailureClass.PERSISTENCE, error="lost"))
        for _ in range(500):
            if not failures and (await store.get_session("s1")).lease_run_id is None:
                break
            await asyncio.sleep(0.01)
        await unended.aclose()
    assert (await store.get_session("s1")).lease_run_id is None
    logged = [r.getMessage() for r in caplog.records
              if getattr(r, "action", None) == "compaction.unended_failed"]
    assert len(logged) == 2, logged
    assert "compactd schema" in logged[0] and "locked" in logged[1]


@pytest.mark.timed
async def test_a_session_whose_row_stays_locked_holds_no_other_sessions_end(
        clean_pg: str) -> None:
    """Each attempt to end a run waits on the database within its own bound: a session whose
    row another transaction keeps locked (no lock timeout would end that wait) fails its
    attempt at the bound and is tried again, and the runs after it are ended meanwhile."""
    store = Store.from_url(clean_pg)
    config = build_config({}, settings=Settings(database_url=clean_pg, broker_url="memory://"))
    deps = Deps(config=config, store=store, limiter=LocalLimiter(), owner="w1")
    end = RunEnd(outcome=RunStatus.FAILED, failure_class=FailureClass.PERSISTENCE, error="lost")
    locker = await asyncpg.connect(clean_pg)
    unended = UnendedRuns(deps, retry_s=0.05, attempt_s=1.0)
    try:
        claims = []
        for session_id in ("locked", "free"):
            await store.create_session(session_id)
            claim = await store.claim(session_id, owner="w1", trigger=RunCause.PRESSURE,
                                      lease_s=600)
            assert isinstance(claim, Claim)
            claims.append(claim)
        lock = locker.transaction()
        await lock.start()
        await locker.execute("SELECT 1 FROM sessions WHERE id = 'locked' FOR UPDATE")
        started = time.monotonic()
        for claim in claims:  # the locked session's run first
            unended.add(claim, end)
        while (await store.get_session("free")).lease_run_id is not None:
            assert time.monotonic() - started < 1.0 + 4.0, (
                "the free session's run was not ended while the other's row was locked")
            await asyncio.sleep(0.05)
        assert (await store.get_session("locked")).lease_run_id is not None
        await lock.rollback()
        while (await store.get_session("locked")).lease_run_id is not None:
            assert time.monotonic() - started < 30.0, "the locked session's run was never ended"
            await asyncio.sleep(0.05)
    finally:
        await unended.aclose()
        await locker.close()
        await store.close()


@pytest.mark.timed
async def test_the_retries_stop_once_the_workers_lease_is_over(
        store: Store, db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past ``worker.lease_s`` the run's lease is the reaper's to end: the retries stop, and a
    database that takes the end again afterwards gets none from this process."""
    config = build_config({"worker": {"lease_s": 0.3}},
                          settings=Settings(database_url=db_url, broker_url="memory://"))
    deps = Deps(config=config, store=store, limiter=LocalLimiter(), owner="w1")
    await store.create_session("s1")
    claim = await store.claim("s1", owner="w1", trigger=RunCause.PRESSURE,
                              lease_s=config.worker.lease_s)
    assert isinstance(claim, Claim)
    taking = False
    attempts = 0
    finish = store.finish

    async def finish_once_taking(*args: Any, **kwargs: Any) -> bool:
        nonlocal attempts
        attempts += 1
        if not taking:
            raise LockNotAvailable()
        return await finish(*args, **kwargs)

    monkeypatch.setattr(store, "finish", finish_once_taking)
    unended = UnendedRuns(deps, retry_s=0.01)
    try:
        unended.add(claim, RunEnd(outcome=RunStatus.FAILED,
                                  failure_class=FailureClass.PERSISTENCE, error="lost"))
        await asyncio.sleep(0.6)
        taking, tried = True, attempts
        await asyncio.sleep(0.3)
    finally:
        await unended.aclose()
    assert tried > 1 and attempts == tried, (tried, attempts)
    assert (await store.get_session("s1")).lease_run_id == claim.run_id
