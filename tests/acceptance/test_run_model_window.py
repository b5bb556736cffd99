"""A session moved to a run model with a smaller window is compacted at once to fit it: the
client's ``set_run_model`` against a real Celery worker, real PostgreSQL and Redis, the fake
provider over HTTP as the summarizer."""

from __future__ import annotations

import asyncio

import pytest

from compactd.client import CompactdClient
from compactd.scheduler.samples import coding_session
from compactd.storage.errors import InvalidMessage
from compactd.storage.kinds import RunCause, RunStatus
from compactd.worker.enqueue import TRIGGER_QUEUES
from compactd.worker.keys import QUEUE_URGENT
from compactd.worker.pressure import window_fit
from compactd.worker.settings import load_config
from tests.support.db import Db
from tests.support.fake_provider import FakeProvider
from tests.support.worker_stack import db

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.redis]
__all__ = ["db"]  # the fixture (tests/support/worker_stack.py)

# Automatic compaction never fires: only the change of model compacts.
POLICY = {"trigger": [{"type": "tokens", "value": 10**9}],
          "keep": {"type": "messages", "value": 4}, "model_name": "fake-gpt",
          "trim_tokens_to_summarize": 100_000}


def test_a_smaller_window_compacts_the_session_at_once_to_fit(make_stack, fake: FakeProvider,
                                                              db: Db) -> None:  # type: ignore[no-untyped-def]
    # One compaction the agent asks for per window: the move's own run is not one of them.
    stack = make_stack(claude=True, summarization=POLICY,
                       worker={"loop_guard": {"max_compactions": 1}})
    stack.ingest("s1", coding_session(steps=20, big_output_lines=30).messages)
    stack.start_worker("w1", concurrency=2)
    config = load_config(env=stack.env)
    before = db.session("s1")
    # The window of the smaller model: the session as it stands fills it.
    small = before.surface_tokens + before.envelope_tokens

    async def move() -> tuple[dict, dict, dict, object]:
        async with CompactdClient(config) as client:
            session = await client.get_session("s1")
            # Bad input first: refused before anything changes.
            with pytest.raises(InvalidMessage, match="context_window"):
                await session.set_run_model("fake-mini", 0)
            larger = await session.set_run_model("fake-claude", 200_000)
            smaller = await session.set_run_model("fake-mini", small)
            run = await session.wait_for_run(smaller["task_id"], 90)
            back = await session.set_run_model("fake-mini", small)
            return larger, smaller, back, run

    larger, smaller, back, run = asyncio.run(move())
    # A larger window: the session fits, nothing is queued.
    assert larger["fit"]["fits"] and not larger["compacting"] and larger["task_id"] is None
    # The smaller one: compacted at once, on compaction.urgent, to fit.
    assert not smaller["fit"]["fits"] and smaller["compacting"]
    assert run.status == RunStatus.COMMITTED and run.trigger == RunCause.WINDOW
    assert TRIGGER_QUEUES[run.trigger] == QUEUE_URGENT
    after = db.session("s1")
    assert after.run_model == "fake-mini" and after.context_window == small
    fit = window_fit(after, config, run_model="fake-mini", window=small)
    assert fit.fits, fit
    assert fit.tokens < small / 2
    # Fitting now, the same move queues nothing more.
    assert back["fit"]["fits"] and not back["compacting"]
    assert len(db.runs("s1")) == 1
    assert fake.requests_for(model="fake-gpt"), "the summary came from the summarizer"

    # The agent's own compact_context is still its to use: the move's run was not its request.
    async def ask() -> dict:
        async with CompactdClient(config) as client:
            session = await client.get_session("s1")
            return await session.compact_context("keep the plan for table users")

    assert asyncio.run(ask())["outcome"] == "queued"
