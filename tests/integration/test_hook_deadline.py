"""The pre-compaction hook within the run's deadline, through the pipeline run in this process on
real SQLite and PostgreSQL: a hook allowed longer than the run has (``events.hook_timeout_s``
above ``worker.deadline_s``) that hangs still leaves the run the time to go on without it.
(The worker's use of the hook is tests/acceptance/test_pre_compaction_hook.py.)"""

from __future__ import annotations

import asyncio
import sys
import types
from collections.abc import Iterator

import pytest

from compactd.storage.kinds import JournalKind, RunCause, RunStatus
from compactd.storage.messages import parse_openai
from compactd.storage.store import Store
from compactd.worker.hooks import PreCompaction
from compactd.worker.orchestration import compact
from compactd.worker.runtime import open_deps
from compactd.worker.settings import Settings, build_config

MESSAGES = [{"role": "user" if i % 2 == 0 else "assistant",
             "content": f"message {i} " + "words " * 200} for i in range(30)]
DEADLINE_S = 4.0


@pytest.fixture
def hanging_hook() -> Iterator[str]:
    module = types.ModuleType("compactd_deadline_hooks")

    async def hangs(run: PreCompaction) -> None:
        await asyncio.sleep(3600)

    module.hangs = hangs  # type: ignore[attr-defined]
    sys.modules[module.__name__] = module
    yield f"{module.__name__}:hangs"
    del sys.modules[module.__name__]


async def test_a_hook_that_hangs_past_the_run_s_deadline_leaves_the_run_its_time(
        db_url: str, hanging_hook: str) -> None:
    config = build_config({"summarization": {"keep": {"type": "messages", "value": 4}},
                           "worker": {"deadline_s": DEADLINE_S},
                           "events": {"pre_compaction": hanging_hook, "hook_timeout_s": 600}},
                          settings=Settings(database_url=db_url, broker_url="memory://"))
    store = Store.from_url(db_url)
    try:
        await store.create_session("s1")
        await store.append("s1", [parse_openai(m) for m in MESSAGES])
    finally:
        await store.close()

    loop = asyncio.get_running_loop()
    started = loop.time()
    async with open_deps(config, owner="test") as deps:
        outcome = await compact(deps, "s1", trigger=RunCause.MANUAL)
        [end] = await deps.store.read_events("s1", kinds=[JournalKind.END])
    took = loop.time() - started

    # The hook was cut short well before the deadline, and the run went on without it.
    assert outcome.outcome == RunStatus.COMMITTED, outcome
    assert outcome.replaced_nodes
    assert took < DEADLINE_S, took
    error = end.payload["hook"]["error"]
    assert error.startswith("the hook did not answer within "), error
    assert float(error.split()[-2]) <= DEADLINE_S / 2, error
