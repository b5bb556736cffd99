"""What the tests of real worker processes share: the store on a clean database, and runs sent
to a stack's broker exactly as the scheduler sends them.

    with enqueuer(stack) as enq:
        enq.send(RunRequest(session_id="s1", trigger="manual"))
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from compactd.storage.kinds import RunCause
from compactd.storage.records import RunRecord
from compactd.worker.app import make_app
from compactd.worker.enqueue import Enqueuer, RunRequest
from compactd.worker.settings import load_config
from tests.support.db import Db
from tests.support.stack import Stack, wait_until

# A summary by fake-gpt in one call, keeping six messages, for sessions of coding_session(steps=20,
# big_output_lines=30), which are over the trigger.
POLICY = {"trigger": [{"type": "tokens", "value": 3000}],
          "keep": {"type": "messages", "value": 6}, "model_name": "fake-gpt",
          "trim_tokens_to_summarize": 16000}


@pytest.fixture
def db(clean_pg: str) -> Iterator[Db]:
    with Db(clean_pg) as handle:
        yield handle


@contextlib.contextmanager
def enqueuer(stack: Stack) -> Iterator[Enqueuer]:
    """Sends runs exactly as the scheduler does, on the stack's broker."""
    app = make_app(load_config(env=stack.env))
    try:
        yield Enqueuer(app)
    finally:
        app.close()


def redeliver_manual(stack: Stack, db: Db, session_id: str, task_id: str,
                     instructions: tuple[str, ...], *, worker: str = "w2") -> RunRecord:
    """The manual task ``task_id``, whose worker was killed, delivered again with its original
    arguments (as the broker would after its visibility timeout) to a new worker on the same
    host (which releases the dead worker's lease at once); its run once it ended."""
    earlier = len(db.runs(session_id))
    with enqueuer(stack) as enq:
        enq.send(RunRequest(session_id, RunCause.MANUAL, task_id=task_id,
                            instructions=instructions))
    stack.start_worker(worker, concurrency=2)
    run: RunRecord = wait_until(
        lambda: next((r for r in db.runs(session_id)[earlier:] if r.finished), None),
        timeout=60, what="the redelivered run to end")
    return run
