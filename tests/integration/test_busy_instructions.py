"""A manual task's delivery that found its session busy hands its instructions back to the
session's mark, on real SQLite and PostgreSQL: when its deliveries' run rows hold more distinct
texts between them than one run takes, the first go back and the task still answers (it raised
``InvalidMessage`` from the bound before)."""

from __future__ import annotations

import logging

import pytest

from compactd.storage.instructions import MAX_INSTRUCTIONS
from compactd.storage.kinds import FailureClass, RunCause, RunStatus
from compactd.storage.messages import parse_openai
from compactd.storage.records import Claim, RunEnd
from compactd.storage.store import KEPT_TASK_ID, Store
from compactd.worker.run import Outcome
from compactd.worker.runtime import open_deps
from compactd.worker.tasks import _keep_instructions
from tests.support.scheduler_sessions import make_config


async def _delivery(store: Store, task_id: str, texts: list[str]) -> None:
    """One delivery of ``task_id`` that took ``texts`` onto its run row, then ended."""
    claim = await store.claim("s1", owner="w", trigger=RunCause.MANUAL, lease_s=60,
                              task_id=task_id)
    assert isinstance(claim, Claim)
    await store.note_instructions(claim.run_id, texts)
    assert await store.finish("s1", run_id=claim.run_id, fence=claim.fence,
                              end=RunEnd(outcome=RunStatus.FAILED,
                                         failure_class=FailureClass.ABANDONED, error="killed"))


async def test_a_busy_delivery_hands_back_the_first_instructions_its_rows_hold(
        db_url: str, caplog: pytest.LogCaptureFixture) -> None:
    store = Store.from_url(db_url)
    try:
        await store.create_session("s1")
        await store.append("s1", [parse_openai({"role": "user", "content": "hello"})])
        first = [f"first delivery's focus {i}" for i in range(MAX_INSTRUCTIONS)]
        second = [f"second delivery's focus {i}" for i in range(MAX_INSTRUCTIONS)]
        await _delivery(store, "t1", first)
        await _delivery(store, "t1", second)
        busy = Outcome(session="s1", run_id=None, outcome=RunStatus.FAILED,
                       failure_class=FailureClass.BUSY, trigger=RunCause.MANUAL)
        with caplog.at_level(logging.WARNING):
            async with open_deps(make_config(db_url), owner="test") as deps:
                await _keep_instructions(deps, "s1", "t1", (first[0],), busy)
        held = await store.clear_manual("s1", KEPT_TASK_ID)
    finally:
        await store.close()
    assert [r for r in caplog.records
            if getattr(r, "action", None) == "compaction.instructions_dropped"]
    assert held == tuple(first)
