"""The ``compaction.run`` task sent again after the database was unavailable (a primary failing
over): the retry is the same request, and the session's manual mark still holds the
instructions of the requests coalesced into it (a run takes them only once it holds the lease:
``Store.take_manual``). The task runs as a worker runs it (``Task.apply``, its own loop thread,
the real database); only the outage is made, by the run raising as a lost connection does."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from compactd.storage.errors import DatabaseUnavailable
from compactd.storage.kinds import RunCause, RunStatus
from compactd.storage.store import Store
from compactd.worker import tasks
from compactd.worker.app import make_app
from compactd.worker.keys import TASK_RUN
from compactd.worker.run import Outcome
from compactd.worker.runtime import process_loop, reset_process_loop
from compactd.worker.settings import Settings, build_config


@pytest.fixture
def worker_loop(db_url: str, tmp_path: Path) -> Iterator[Any]:
    """The app and this process's loop thread on the test's database, as a worker has them."""
    config = build_config({}, settings=Settings(database_url=db_url, home=str(tmp_path),
                                                broker_url="memory://"), home=tmp_path)
    reset_process_loop()
    loop = process_loop(config)
    try:
        yield make_app(config, with_tasks=True)
    finally:
        loop.close()
        reset_process_loop()


async def _mark(db_url: str) -> None:
    store = Store.from_url(db_url)
    try:
        await store.create_session("s1")
        assert await store.mark_manual("s1", "T1", ttl_s=120,
                                       instructions=["focus on the migration"]) == "T1"
        # A request coalesced into the queued task: its note is on the mark only.
        assert await store.mark_manual("s1", "T2", ttl_s=120,
                                       instructions=["keep the error names"]) == "T1"
    finally:
        await store.close()


def test_a_run_retried_after_the_database_was_unavailable_keeps_its_coalesced_instructions(
        db_url: str, worker_loop: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    asyncio.run(_mark(db_url))
    given: list[tuple[str, ...]] = []

    async def compact(deps: Any, session_id: str, *, instructions: Sequence[str] = (),
                      **_: Any) -> Outcome:
        if not given:
            given.append(tuple(instructions))
            # Lost before the claim: nothing was taken off the mark.
            raise DatabaseUnavailable("the database cannot be reached: Connection refused")
        # The retry holds the lease: its run takes what the mark kept (no run row here).
        given.append(await deps.store.take_manual(session_id, "T1", run_id="no-row",
                                                  instructions=instructions))
        return Outcome(session_id, None, RunStatus.NOTHING_TO_DO, trigger=RunCause.MANUAL)

    monkeypatch.setattr(tasks, "compact", compact)
    worker_loop.tasks[TASK_RUN].apply(
        kwargs={"session_id": "s1", "trigger": RunCause.MANUAL,
                "instructions": ["focus on the migration"]}, task_id="T1")
    own = ("focus on the migration",)
    assert given == [own, (*own, "keep the error names")]
