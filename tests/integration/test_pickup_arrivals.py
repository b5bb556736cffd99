"""What a run expects to arrive before its pickup (``worker.pickup``), on both backends: the
session's appends as they were made (their times in the events), read once, counted at their
cadence; the growth rate when the session paused, or when the appends cannot be read."""

from __future__ import annotations

import datetime as dt
import logging
from typing import Any

import pytest

from compactd.storage.errors import StorageError
from compactd.storage.records import Claim, RunEnd, SessionInfo, utcnow
from compactd.storage.store import Store
from compactd.worker.compaction.arrivals import Arrivals
from compactd.worker.compaction.policy import Policy
from compactd.worker.pickup import predict_arrivals
from compactd.worker.settings import build_config
from tests.support.surfaces import ai, sys, tool, user

STEP_S = 0.1
STEPS = 16
CLAIM_TO_COMMIT_S = 0.3
CONFIG = build_config({})


def _step(i: int, observation: str | None = None) -> list[Any]:
    return [ai(f"step {i}", (f"c{i}", "read_file")),
            tool(f"c{i}", observation or f"the file's line {i}")]


async def _stepping_session(store: Store, start: dt.datetime) -> SessionInfo:
    """A session whose agent appended a step every STEP_S, one of them a long observation (a
    SWE-agent session's); its last append STEPS * STEP_S after ``start``."""
    await store.create_session("s1", run_model="gpt-4o", now=start)
    await store.append("s1", [sys(), user("fix the bug")], now=start)
    for i in range(1, STEPS + 1):
        observation = " ".join(f"line{k}" for k in range(4_000)) if i == 10 else None
        await store.append("s1", _step(i, observation),
                           now=start + dt.timedelta(seconds=i * STEP_S))
    return await store.get_session("s1")


async def _claim_to_commit_measured(store: Store, start: dt.datetime) -> None:
    """A recent run of another session whose first checkpoint came CLAIM_TO_COMMIT_S after its
    claim: what a run expects its own to take."""
    await store.create_session("earlier", run_model="gpt-4o", now=start)
    claim = await store.claim("earlier", owner="w", trigger="pressure", lease_s=60, now=start)
    assert isinstance(claim, Claim)
    assert await store.finish("earlier", run_id=claim.run_id, fence=claim.fence,
                              end=RunEnd(outcome="committed", model="gpt-4o",
                                         stages={"claim_to_commit_s": CLAIM_TO_COMMIT_S}),
                              now=start + dt.timedelta(seconds=CLAIM_TO_COMMIT_S))


async def _predict(store: Store, info: SessionInfo, now: dt.datetime) -> Arrivals | None:
    surface = await store.read_surface(info.id)
    return await predict_arrivals(store, CONFIG, info, Policy(), surface.nodes, now)


async def test_the_appends_expected_are_counted_at_the_sessions_cadence(store: Store) -> None:
    start = utcnow() - dt.timedelta(seconds=10)
    await _claim_to_commit_measured(store, start)
    info = await _stepping_session(store, start)
    claimed_at = info.last_append_at + dt.timedelta(seconds=STEP_S / 2)  # type: ignore[operator]
    arrivals = await _predict(store, info, claimed_at)
    assert arrivals is not None
    # Three steps of two messages to the commit, and the step before the pickup: the large
    # observation among them neither shrinks the count nor sets the step's size.
    assert (arrivals.measure, arrivals.messages) == ("appends", 8), arrivals
    assert arrivals.to_json()["append_interval_s"] == pytest.approx(STEP_S)
    assert arrivals.pickup_step.messages == 2
    assert arrivals.pickup_step.tokens < 100


async def test_a_session_that_paused_is_expected_to_grow_at_its_growth_rate(
        store: Store) -> None:
    start = utcnow() - dt.timedelta(seconds=120)
    await _claim_to_commit_measured(store, start)
    info = await _stepping_session(store, start)
    paused = info.last_append_at + dt.timedelta(seconds=60)  # type: ignore[operator]
    arrivals = await _predict(store, info, paused)
    assert arrivals is not None
    assert arrivals.measure == "growth_rate"
    assert arrivals.to_json()["append_interval_s"] is None


async def test_appends_that_cannot_be_read_leave_the_growth_rate(
        store: Store, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    start = utcnow() - dt.timedelta(seconds=10)
    await _claim_to_commit_measured(store, start)
    info = await _stepping_session(store, start)

    async def unreadable(session_id: str, *, limit: int) -> Any:
        raise StorageError("the database went away")

    monkeypatch.setattr(store, "recent_messages", unreadable)
    with caplog.at_level(logging.WARNING, logger="compactd.worker.pickup"):
        arrivals = await _predict(store, info, info.last_append_at)  # type: ignore[arg-type]
    assert arrivals is not None and arrivals.measure == "growth_rate"
    assert [r.action for r in caplog.records] == ["keep_at.appends_unread"]  # type: ignore[attr-defined]
