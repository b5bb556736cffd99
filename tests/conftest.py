"""Shared fixtures: real PostgreSQL and Redis when they answer, the embedded SQLite always.

A missing service skips its tests locally and FAILS them in CI (``CI=true``): in CI a missing
service is a broken environment, never a reason to pass.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import NoReturn
from urllib.parse import urlparse

import pytest
from hypothesis import settings

from tests.support.services import (
    create_database_sync,
    drop_database_sync,
    empty_database,
    flush_redis,
    with_database,
)

REPO = Path(__file__).resolve().parents[1]
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")

# In CI the property tests replay the same examples every run: a red build is a real change,
# never a new random draw. Locally they keep exploring (and remember what failed).
settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
if IN_CI:
    settings.load_profile("ci")
BASE_PG_URL = os.environ.get("COMPACTD_TEST_DATABASE_URL",
                             "postgresql://postgres@127.0.0.1:5432/compactd_test")
BASE_REDIS_URL = os.environ.get("COMPACTD_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
# Under pytest-xdist (``-n 2``) each worker process is named gw0, gw1, ... and runs its tests on
# services of its own: the fixtures below drop the PostgreSQL database and flush the Redis
# database, and the Celery workers a test starts consume every queue of that Redis database.
XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")


def worker_database_url(url: str, worker: str) -> str:
    """The xdist worker's own PostgreSQL database: the name plus ``_gw0``, ``_gw1``, ...;
    outside xdist the URL as given."""
    if not worker:
        return url
    return with_database(url, f"{urlparse(url).path.lstrip('/')}_{worker}")


def worker_redis_url(url: str, worker: str) -> str:
    """The xdist worker's own Redis database: gw0 keeps the given number, gw1 the one below it,
    and so on (the default 15 leaves 15, 14, ... to the workers); outside xdist the URL as given."""
    if not worker:
        return url
    parsed = urlparse(url)
    base = int(parsed.path.lstrip("/") or 0)
    db = base - int(worker.removeprefix("gw"))
    if db < 0:
        raise pytest.UsageError(
            f"COMPACTD_TEST_REDIS_URL names Redis database {base}, too low for xdist worker "
            f"{worker}: worker gwN uses database {base}-N; name a higher database or run fewer "
            f"workers (-n)")
    return parsed._replace(path=f"/{db}").geturl()


def pytest_configure(config: pytest.Config) -> None:
    from tests.support.schedule import register_file_seconds

    register_file_seconds(config)


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """``--dist loadfile`` with the longest files first (tests/support/schedule.py)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from tests.support.schedule import LongestFileFirst

    return LongestFileFirst(config, log)


# The build of compactd as a user installs it, when the run has tests that need it
# (tests/support/install.py): started on collection, so it overlaps the tests run before them.
_INSTALL_BUILD: list[subprocess.Popen[bytes]] = []


def pytest_collection_finish(session: pytest.Session) -> None:
    from tests.support.install import NEEDED_BY, start_in_background

    if session.config.option.collectonly or not any(
            item.path.name in NEEDED_BY for item in session.items):
        return
    factory: pytest.TempPathFactory = session.config._tmp_path_factory  # type: ignore[attr-defined]
    build = start_in_background(factory)
    if build is not None:
        _INSTALL_BUILD.append(build)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    for build in _INSTALL_BUILD:
        # Another xdist worker may still be waiting for it; a run stopped early (-x, ^C)
        # leaves none behind.
        if session.shouldstop or session.shouldfail or exitstatus == pytest.ExitCode.INTERRUPTED:
            os.killpg(build.pid, signal.SIGKILL)
        build.wait()


PG_URL = worker_database_url(BASE_PG_URL, XDIST_WORKER)
REDIS_URL = worker_redis_url(BASE_REDIS_URL, XDIST_WORKER)


def _answers(url: str, default_port: int) -> bool:
    parsed = urlparse(url)
    try:
        with socket.create_connection((parsed.hostname or "127.0.0.1",
                                       parsed.port or default_port), timeout=1):
            return True
    except OSError:
        return False


def require_service(name: str, url: str, default_port: int) -> None:
    if _answers(url, default_port):
        return
    missing(f"{name} does not answer at {url}; start it (ops/test starts local servers) or "
            f"set the COMPACTD_TEST_* URL")


def missing(message: str) -> NoReturn:
    """Something a test needs is not on this machine: a failure in CI, a skip elsewhere."""
    if IN_CI:
        pytest.fail(f"CI: {message}")
    pytest.skip(message)


@pytest.fixture(scope="session")
def pg_url() -> str:
    require_service("PostgreSQL", PG_URL, 5432)
    return PG_URL


@pytest.fixture(scope="session")
def redis_url() -> str:
    require_service("Redis", REDIS_URL, 6379)
    return REDIS_URL


def _migrate(url: str) -> None:
    from compactd.storage.migrate import upgrade

    upgrade(url)


@pytest.fixture(scope="session")
def pg_schema(pg_url: str) -> str:
    """The test database, made anew and migrated to head once per test run: a database left by
    a run of other code (a migration edited since, a branch's revision) must not decide this one."""
    drop_database_sync(pg_url)
    create_database_sync(pg_url)
    _migrate(pg_url)
    return pg_url


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An embedded database migrated to head once per test process, copied for each test that
    needs one: the same file the first ``compactd`` command in an empty home makes."""
    path = tmp_path_factory.mktemp("sqlite-template") / "template.sqlite3"
    _migrate(f"sqlite:///{path}")
    return path


@pytest.fixture
def clean_pg(pg_schema: str) -> str:
    """The PostgreSQL test database, emptied."""
    asyncio.run(empty_database(pg_schema))
    return pg_schema


@pytest.fixture
def sqlite_url(sqlite_template: Path, tmp_path: Path) -> str:
    """A fresh, migrated SQLite file."""
    path = tmp_path / "compactd.sqlite3"
    shutil.copy(sqlite_template, path)
    return f"sqlite:///{path}"


@pytest.fixture(params=["sqlite", "postgres"])
def db_url(request: pytest.FixtureRequest) -> str:
    """A fresh migrated database of each kind: the embedded default and PostgreSQL."""
    if request.param == "postgres":
        return str(request.getfixturevalue("clean_pg"))
    return str(request.getfixturevalue("sqlite_url"))


@pytest.fixture
async def store(db_url: str) -> AsyncIterator[object]:
    from compactd.storage.store import Store

    st = Store.from_url(db_url)
    try:
        yield st
    finally:
        await st.close()


def isolated_cli_env(home: Path) -> dict[str, str]:
    """Environment for running ``compactd`` as a subprocess with ``home`` as its home, isolated
    from the developer's."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMPACTD_")}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["COMPACTD_HOME"] = str(home)
    return env


@pytest.fixture
def cli_env(tmp_path: Path, sqlite_template: Path) -> Iterator[dict[str, str]]:
    """Environment for running ``compactd`` as a subprocess, isolated from the developer's: a
    home of its own holding a copy of the migrated embedded database, so that the test's first
    command does not run the migration chain again (each test still has its own file). A test
    of what the first command in an empty home does takes ``bare_cli_env``."""
    from compactd.storage.database import SQLITE_FILENAME

    shutil.copy(sqlite_template, tmp_path / SQLITE_FILENAME)
    yield isolated_cli_env(tmp_path)


@pytest.fixture
def bare_cli_env(tmp_path: Path) -> Iterator[dict[str, str]]:
    """``cli_env`` with an empty home: the embedded database is created and migrated by the
    test's first command, as on a user's machine."""
    yield isolated_cli_env(tmp_path)


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def module_cli_env(request: pytest.FixtureRequest,
                   tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A ``cli_env`` for the tests of one module that only read what its first user stored: a
    home of its own and, on PostgreSQL, a database of its own (``clean_pg`` empties the shared
    one between tests), made once per module and kind. ``TEST_DATABASE_URL`` names the database
    for the test's own reads; compactd does not read it."""
    home = tmp_path_factory.mktemp("module-cli")
    env = isolated_cli_env(home)
    if request.param == "sqlite":
        from compactd.storage.database import embedded_url

        env["TEST_DATABASE_URL"] = embedded_url(home)
        yield env
        return
    base = str(request.getfixturevalue("pg_url"))
    module = request.module.__name__.rsplit(".", 1)[-1]
    url = with_database(base, f"{urlparse(base).path.lstrip('/')}_{module}")
    drop_database_sync(url)
    create_database_sync(url)
    env["COMPACTD_DATABASE_URL"] = env["TEST_DATABASE_URL"] = url
    try:
        yield env
    finally:
        drop_database_sync(url)


def compactd_cmd() -> list[str]:
    return [sys.executable, "-m", "compactd.scheduler.cli"]


def run_cli(env: dict[str, str], *args: str, check: bool = True,
            timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``compactd ARGS`` as a subprocess; with ``check``, a non-zero exit fails the test."""
    from tests.support import cli_launcher

    out = cli_launcher.run(env, args, timeout=timeout)
    if check and out.returncode != 0:
        raise AssertionError(f"compactd {' '.join(args)} -> {out.returncode}\n{out.stderr}")
    return out


@pytest.fixture
def clean_redis(redis_url: str) -> str:
    """The test Redis database, flushed (broker queues, rate meters)."""
    flush_redis(redis_url)
    return redis_url


@pytest.fixture
def fake():  # type: ignore[no-untyped-def]
    """The fake provider on 127.0.0.1, in this process."""
    from tests.support.fake_provider import FakeProvider

    with FakeProvider() as provider:
        yield provider


@pytest.fixture
def make_stack(clean_pg: str, clean_redis: str, tmp_path: Path, fake):  # type: ignore[no-untyped-def]
    """A factory of :class:`tests.support.stack.Stack` on clean PostgreSQL and Redis."""
    from tests.support.stack import Stack

    stacks: list[Stack] = []

    def make(**kwargs: object) -> Stack:
        kwargs.setdefault("fake_url", fake.url)
        stack = Stack(clean_pg, clean_redis, tmp_path / f"stack{len(stacks)}", **kwargs)  # type: ignore[arg-type]
        stacks.append(stack)
        return stack

    yield make
    for stack in stacks:
        stack.close()
