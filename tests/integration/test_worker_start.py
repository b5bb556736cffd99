"""What a worker does as it becomes ready (``worker_ready``), on the real database: it releases
the leases of this host's worker processes that are gone, and leaves nothing open behind in
the process that does it, which on a prefork pool is the parent that forks the children."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
from celery.concurrency.prefork import TaskPool

from compactd.storage.kinds import RunCause
from compactd.storage.records import Claim
from compactd.storage.store import Store
from compactd.worker import tasks
from compactd.worker.app import make_app
from compactd.worker.runtime import reset_process_loop
from compactd.worker.settings import Settings, build_config


def _gone_pid() -> int:
    """The pid of a process of this host that has exited."""
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    return int(done.stdout)


async def _lease_of_a_dead_worker(db_url: str, owner: str) -> str:
    store = Store.from_url(db_url)
    try:
        await store.create_session("s1")
        claim = await store.claim("s1", owner=owner, trigger=RunCause.PRESSURE, lease_s=600)
        assert isinstance(claim, Claim)
        return claim.run_id
    finally:
        await store.close()


async def _lease_run(db_url: str) -> str | None:
    store = Store.from_url(db_url)
    try:
        return (await store.get_session("s1")).lease_run_id
    finally:
        await store.close()


def test_a_prefork_parent_releases_dead_leases_and_keeps_no_loop_thread_after(
        db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = build_config({}, settings=Settings(database_url=db_url, home=str(tmp_path),
                                                broker_url="memory://"), home=tmp_path)
    owner = f"{socket.gethostname()}:{_gone_pid()}"
    assert asyncio.run(_lease_of_a_dead_worker(db_url, owner)) is not None
    reset_process_loop()
    threads = threading.active_count()
    sender = SimpleNamespace(app=make_app(config), pool=TaskPool.__new__(TaskPool))
    tasks._on_ready(sender=sender)
    assert asyncio.run(_lease_run(db_url)) is None
    # The parent forks its children after this: no loop thread (and its pooled connections)
    # may be left running in it.
    assert threading.active_count() == threads
