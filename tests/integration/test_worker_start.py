"""What a worker does as it becomes ready (``worker_ready``), on the real database: it releases
the leases of this host's worker processes that are gone, and leaves nothing open behind in
the process that does it, which on a prefork pool is the parent that forks the children."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from celery.concurrency.prefork import TaskPool

from compactd.storage.kinds import RunCause
from compactd.storage.records import Claim
from compactd.storage.store import Store
from compactd.worker import tasks
from compactd.worker.app import make_app
from compactd.worker.owners import Owner, format_owner, this_process
from compactd.worker.runtime import reset_process_loop
from compactd.worker.settings import Config, Settings, build_config
from compactd.worker.sweeps import release_dead_leases
from tests.support.enqueuer import RecordingEnqueuer


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
    owner = format_owner(Owner(this_process().host, _gone_pid(), this_process().namespace))
    assert asyncio.run(_lease_of_a_dead_worker(db_url, owner)) is not None
    reset_process_loop()
    threads = set(threading.enumerate())
    sender = SimpleNamespace(app=make_app(config), pool=TaskPool.__new__(TaskPool))
    tasks._on_ready(sender=sender)
    assert asyncio.run(_lease_run(db_url)) is None
    # The parent forks its children after this: no loop thread (and its pooled connections)
    # may be left running in it.
    # No new thread (one of the session's setup may end meanwhile: a count would flake). A
    # closed SQLite connection's thread ends just after its close returns: on a loaded machine
    # it was still seen, so a thread gets a moment to end; one that stays is the leak.
    deadline = time.monotonic() + 5.0
    while not set(threading.enumerate()) <= threads and time.monotonic() < deadline:
        time.sleep(0.05)
    assert set(threading.enumerate()) <= threads


def _config(db_url: str, home: Path) -> Config:
    return build_config({}, settings=Settings(database_url=db_url, home=str(home),
                                              broker_url="memory://"), home=home)


async def test_only_dead_leases_of_this_pid_namespace_are_released(
        db_url: str, tmp_path: Path) -> None:
    me = this_process()
    assert me.namespace is not None, "these tests run on Linux, where /proc/self/ns/pid exists"
    dead = _gone_pid()
    owners = {
        # A container sharing this host name, in its own PID namespace: its pid cannot be
        # checked from here, and must not be taken for a dead one.
        "other_namespace": format_owner(Owner(me.host, dead, "pidns4026532999." + "0" * 36)),
        # A lease of the release before this one (``host:pid``): it expires.
        "old_form": f"{me.host}:{dead}",
        "other_host": format_owner(Owner("another-host", dead, me.namespace)),
        # Alive here (this process's parent): left to the reaper.
        "alive": format_owner(Owner(me.host, os.getppid(), me.namespace)),
        "dead": format_owner(Owner(me.host, dead, me.namespace)),
    }
    store = Store.from_url(db_url)
    try:
        for sid, owner in owners.items():
            await store.create_session(sid)
            claim = await store.claim(sid, owner=owner, trigger=RunCause.PRESSURE, lease_s=600)
            assert isinstance(claim, Claim)
        released = await release_dead_leases(store, _config(db_url, tmp_path),
                                             RecordingEnqueuer(), me=me)
        assert [lease.session_id for lease in released] == ["dead"]
        for sid, owner in owners.items():
            info = await store.get_session(sid)
            assert info.lease_owner == (None if sid == "dead" else owner), sid
    finally:
        await store.close()


async def test_a_process_with_no_pid_namespace_releases_nothing(
        db_url: str, tmp_path: Path) -> None:
    host = this_process().host
    dead = _gone_pid()
    store = Store.from_url(db_url)
    try:
        await store.create_session("s1")
        await store.claim("s1", owner=f"{host}:{dead}", trigger=RunCause.PRESSURE, lease_s=600)
        released = await release_dead_leases(store, _config(db_url, tmp_path),
                                             RecordingEnqueuer(),
                                             me=Owner(host, os.getpid(), None))
        assert released == []
        assert (await store.get_session("s1")).lease_owner == f"{host}:{dead}"
    finally:
        await store.close()
