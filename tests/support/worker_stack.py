"""What the tests of real worker processes share: the store on a clean database, and runs sent
to a stack's broker exactly as the scheduler sends them.

    with enqueuer(stack) as enq:
        enq.send(RunRequest(session_id="s1", trigger="manual"))
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from compactd.worker.app import make_app
from compactd.worker.enqueue import Enqueuer
from compactd.worker.settings import load_config
from tests.support.db import Db
from tests.support.stack import Stack


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
