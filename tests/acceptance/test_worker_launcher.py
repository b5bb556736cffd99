"""A stack's worker (and its `compactd serve`) is a fork of a launcher that imported its
third-party modules (tests/support/cli_launcher.py): still a process of its own, in a session of
its own, reading its own environment, and read as a ``subprocess.Popen`` is."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable

import psutil
import pytest

from tests.support import cli_launcher
from tests.support.api import start_api
from tests.support.stack import WORKER_IMPORTS, Stack

pytestmark = pytest.mark.slow

MakeStack = Callable[..., Stack]


@pytest.fixture(autouse=True)
def _launched(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(cli_launcher.WORKER_SWITCH_ENV, raising=False)


def test_a_launched_worker_leads_its_session_and_is_reaped_when_killed(
        make_stack: MakeStack) -> None:
    stack = make_stack()
    worker = stack.start_worker("w1", concurrency=2)
    assert isinstance(worker, cli_launcher.Launched)
    assert os.getsid(worker.pid) == os.getpgid(worker.pid) == worker.pid
    assert psutil.Process(worker.pid).ppid() != os.getpid()  # the launcher's child
    assert worker.poll() is None

    stack.kill("w1")  # kill -9 to the worker's process group

    assert worker.returncode == -signal.SIGKILL
    assert not psutil.pid_exists(worker.pid)  # reaped by the launcher, not left a zombie


def test_launched_workers_read_their_own_environment_and_end_warm(
        make_stack: MakeStack) -> None:
    as_json = make_stack()
    as_text = make_stack(extra_env={"COMPACTD_LOG_FORMAT": "text"})
    launcher = cli_launcher._launcher(sys.executable, as_json.env, module="celery",
                                      imports=WORKER_IMPORTS)
    assert launcher is cli_launcher._launcher(sys.executable, as_text.env, module="celery",
                                              imports=WORKER_IMPORTS)
    workers = [as_json.start_worker("w1", concurrency=2),
               as_text.start_worker("w2", concurrency=2)]

    assert '"msg": "w1@' in as_json.log("w1")
    assert "w2@" in as_text.log("w2") and '"msg": ' not in as_text.log("w2")
    as_json.stop("w1")
    as_text.stop("w2")
    assert [worker.returncode for worker in workers] == [0, 0]


def test_a_launched_server_leads_its_session_and_ends_on_sigterm(make_stack: MakeStack) -> None:
    stack = make_stack()
    start_api(stack)
    server = stack.procs["api"]
    assert isinstance(server, cli_launcher.Launched)
    assert os.getsid(server.pid) == server.pid
    stack.stop("api")  # SIGTERM: the server ends by it, as a fresh interpreter's does
    assert server.returncode == -signal.SIGTERM, stack.log("api")[-3000:]
