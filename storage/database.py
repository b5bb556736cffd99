"""Engines, transactions, deadlines and driver errors, the same calls on every backend.

PostgreSQL is reached through asyncpg; the embedded default is a SQLite file through aiosqlite.
What each does differently is its backend's (``storage.connectors_engines``, the drivers'
errors in ``storage.connectors_errors``). Every transaction here is short: none is ever held
open across a model call.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from compactd.storage import sql
from compactd.storage.connectors_engines import backend_for_url, backend_of
from compactd.storage.connectors_errors import is_driver_error, storage_error
from compactd.storage.errors import CompactdError, DatabaseFileMissing, DeadlinePassed

SQLITE_FILENAME = "compactd.sqlite3"

# The end of the work this task is doing (a compaction run), in its event loop's time, or None.
# Statements run under it wait no longer: lock waits and statements of a transaction get the
# time left as PostgreSQL's lock_timeout and statement_timeout (SQLite: its busy timeout), and
# the single statements of storage.connectors_kept are cancelled when it passes.
_DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "compactd_deadline", default=None)


@contextlib.contextmanager
def deadline(at: float | None) -> Any:
    """Bound the statements run inside the block (and in tasks it starts) by ``at``."""
    token = _DEADLINE.set(at)
    try:
        yield
    finally:
        _DEADLINE.reset(token)


def deadline_left_s() -> float | None:
    """Seconds left before the current :func:`deadline` (0 or less once it passed), None
    without one."""
    at = _DEADLINE.get()
    return None if at is None else at - asyncio.get_running_loop().time()


def _time_left_ms() -> int | None:
    """Milliseconds left before the deadline, None without one; DeadlinePassed once it passed
    (never 0: PostgreSQL and SQLite read a zero timeout as none at all)."""
    left = deadline_left_s()
    if left is None:
        return None
    if left <= 0:
        raise DeadlinePassed()
    return max(1, int(left * 1000))


@contextlib.asynccontextmanager
async def cancelled_at_deadline() -> AsyncIterator[None]:
    """Cancel the block when the deadline passes (asyncpg then cancels its statement on the
    server, and the connection stays usable: ``storage.connectors_kept``)."""
    at = _DEADLINE.get()
    if at is None:
        yield
        return
    _time_left_ms()
    try:
        async with asyncio.timeout_at(at):
            yield
    except TimeoutError:
        raise DeadlinePassed() from None


def embedded_url(home: str | os.PathLike[str] | None = None) -> str:
    """The SQLite file used when no database URL is configured."""
    base = Path(home or os.environ.get("COMPACTD_HOME") or ".").expanduser().resolve()
    return f"sqlite+aiosqlite:///{base / SQLITE_FILENAME}"


def database_exists(url: str) -> bool:
    """Whether the database ``url`` names is there to open without creating it: a SQLite file
    that exists (or an in-memory one); any server database, which only ``migrate`` creates."""
    return backend_for_url(url).exists(url)


def require_database(url: str) -> None:
    """Raise :class:`DatabaseFileMissing` naming the file when ``url`` is a SQLite file that is
    not there, for a command that only reads (opening it would create it)."""
    if not database_exists(url):
        raise DatabaseFileMissing(str(sa.engine.make_url(normalize_url(url)).database))


def normalize_url(url: str) -> str:
    """Accept the URLs people write and pick the async driver for them."""
    return backend_for_url(url).normalize(url)


def create_engine(url: str, *, pool_size: int = 10, max_overflow: int | None = None,
                  statement_cache: bool = True, echo: bool = False) -> AsyncEngine:
    """An async engine for ``url``; create one per process and per event loop, never share it.

    On PostgreSQL it keeps ``pool_size`` connections and opens up to ``max_overflow`` more
    (default: as many again) for bursts, closing those on return. ``statement_cache=False``
    (``database.statement_cache``) prepares nothing by name, for a pooler in transaction mode
    that hands a connection's statements to any server connection."""
    url = normalize_url(url)
    return backend_for_url(url).create_engine(url, pool_size=pool_size,
                                              max_overflow=max_overflow,
                                              statement_cache=statement_cache, echo=echo)


def translate(exc: BaseException) -> CompactdError:
    """Storage's own exception for a driver error (:func:`storage_error`), under the current
    :func:`deadline` if there is one."""
    return storage_error(exc, under_deadline=_DEADLINE.get() is not None)


@contextlib.contextmanager
def translated() -> Any:
    """Turn any driver error raised inside into storage's own exception."""
    try:
        yield
    except CompactdError:
        raise
    except Exception as exc:
        if is_driver_error(exc):
            raise translate(exc) from exc
        raise


@contextlib.asynccontextmanager
async def transaction(engine: AsyncEngine) -> AsyncIterator[AsyncConnection]:
    """One short transaction, with driver errors translated; under a :func:`deadline`, its
    lock waits and statements end when the deadline does."""
    with translated():
        left_ms = _time_left_ms()
        if left_ms is None:
            async with engine.begin() as conn:
                yield conn
            return
        async with engine.connect() as conn, backend_of(engine).bounded(conn, left_ms):
            yield conn


@contextlib.asynccontextmanager
async def connection(engine: AsyncEngine) -> AsyncIterator[AsyncConnection]:
    """A connection for reads of one statement each: no BEGIN/ROLLBACK round trips on
    PostgreSQL (autocommit), and never queued behind a writer on SQLite."""
    with translated():
        async with engine.connect() as conn:
            await conn.execution_options(**backend_of(engine).read_options)
            yield conn


@contextlib.asynccontextmanager
async def snapshot(engine: AsyncEngine) -> AsyncIterator[AsyncConnection]:
    """A connection whose statements all see one consistent snapshot (multi-statement reads)."""
    with translated():
        async with engine.connect() as conn:
            await conn.execution_options(**backend_of(engine).snapshot_options)
            async with conn.begin():
                yield conn


async def ping(engine: AsyncEngine) -> None:
    async with connection(engine) as conn:
        await conn.execute(_PING)


# Named queries this module runs through SQLAlchemy (the connectors run the others).
_PING = sa.text(sql.NAMED_TEXT["ping"])
