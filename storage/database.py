"""Engines, transactions and the translation of driver errors.

PostgreSQL is reached through asyncpg; the embedded default is a SQLite file through aiosqlite.
Every transaction here is short: none is ever held open across a model call.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from compactd.storage import sql
from compactd.storage.connectors_engines import POOL_RECYCLE_S, backend_for_url, backend_of
from compactd.storage.connectors_errors import connection_survives, is_driver_error, storage_error
from compactd.storage.errors import CompactdError, DeadlinePassed

SQLITE_FILENAME = "compactd.sqlite3"

# The end of the work this task is doing (a compaction run), in its event loop's time, or None.
# Statements run under it wait no longer: lock waits and statements of a transaction get the
# time left as PostgreSQL's lock_timeout and statement_timeout (SQLite: its busy timeout), and
# the single statements of raw_connection are cancelled when it passes.
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
async def _bounded() -> AsyncIterator[None]:
    """Cancel the block when the deadline passes (asyncpg then cancels its statement on the
    server, and the connection stays usable)."""
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


@contextlib.asynccontextmanager
async def raw_connection(engine: AsyncEngine) -> AsyncIterator[Any]:
    """The asyncpg connection under a pooled SQLAlchemy connection, in autocommit mode, for one
    named query without SQLAlchemy's statement layer (asyncpg's own statement cache serves it).

    Errors are translated like everywhere else; a connection the error leaves in an unknown
    state is invalidated, so the pool opens a new one instead of handing it out again. Callers
    that raise compactd's own SQLSTATEs inspect them first.
    """
    with translated():
        async with _open_raw(engine) as (conn, driver):
            try:
                async with _bounded():
                    yield driver
            except BaseException as exc:
                if driver.is_closed() or not connection_survives(exc):
                    with contextlib.suppress(Exception):
                        await conn.invalidate()
                raise


class KeptConnections:
    """Up to ``capacity`` pooled PostgreSQL connections kept checked out for the named queries
    a process runs over and over, instead of a pool checkout and return around each.

    A checkout and its return through SQLAlchemy cost several times the CPU of the statement
    they serve (measured in alternating pairs; the figures are in docs/benchmarks.md). The
    connections are the pool's own (no extra server connections) and are taken at first use,
    so a process that never runs these statements holds none. A statement that finds every
    kept connection busy goes through the pool as before, so the pool always has
    ``pool_size - capacity`` connections for everything else. A connection that fails is
    dropped and taken afresh by a later statement; refused and cancelled statements leave it
    in place. Each goes back to the pool as often as the pool recycles its own connections
    (``pool_recycle``), so they are renewed as those are. With a capacity of 0 every statement
    goes through the pool.
    """

    def __init__(self, engine: AsyncEngine, capacity: int = 1) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be 0 or more, not {capacity}")
        self._engine = engine
        self.capacity = capacity
        self._idle: list[_Kept] = []
        self._held = 0  # kept connections, idle or in use
        self._generation = 0  # close() drops those in use when they come back

    @contextlib.asynccontextmanager
    async def use(self) -> AsyncIterator[Any]:
        kept = await self._checkout()
        if kept is None:
            async with raw_connection(self._engine) as raw:
                yield raw
            return
        try:
            with translated():
                try:
                    async with _bounded():
                        yield kept.raw
                except BaseException as exc:
                    if kept.raw.is_closed() or not connection_survives(exc):
                        dropped, kept = kept, None
                        await self._drop(dropped, broken=True)
                    raise
        finally:
            if kept is not None:
                await self._give_back(kept)

    async def close(self) -> None:
        self._generation += 1
        idle, self._idle = self._idle, []
        for kept in idle:
            await self._drop(kept, broken=False)

    async def _checkout(self) -> _Kept | None:
        while self._idle:
            kept = self._idle.pop()
            if not kept.raw.is_closed() and time.monotonic() - kept.taken_at <= POOL_RECYCLE_S:
                return kept
            await self._drop(kept, broken=kept.raw.is_closed())
        if self._held >= self.capacity:
            return None
        self._held += 1
        # Read before connecting: a close() while it connects makes this one stale too.
        generation = self._generation
        try:
            with translated():
                conn = await self._engine.connect()
                try:
                    raw = (await conn.get_raw_connection()).driver_connection
                except BaseException:
                    with contextlib.suppress(Exception):
                        await conn.close()
                    raise
        except BaseException:
            self._held -= 1
            raise
        return _Kept(conn, raw, time.monotonic(), generation)

    async def _give_back(self, kept: _Kept) -> None:
        """Keep ``kept`` for the next statement, unless close() ran since it was taken."""
        if kept.generation == self._generation:
            self._idle.append(kept)
        else:
            await self._drop(kept, broken=False)

    async def _drop(self, kept: _Kept, *, broken: bool) -> None:
        self._held -= 1
        if broken:
            # Its state is unknown (a statement may still be running): never reuse it.
            with contextlib.suppress(Exception):
                await kept.conn.invalidate()
        with contextlib.suppress(Exception):
            await kept.conn.close()


@dataclass
class _Kept:
    conn: AsyncConnection
    raw: Any
    taken_at: float
    generation: int


@contextlib.asynccontextmanager
async def _open_raw(engine: AsyncEngine) -> AsyncIterator[tuple[AsyncConnection, Any]]:
    """A pooled connection in autocommit and its asyncpg connection, skipping those the client
    has already seen closed (the server ended them while they sat in the pool)."""
    while True:
        async with engine.connect() as conn:
            fairy = await conn.get_raw_connection()
            driver = fairy.driver_connection
            assert driver is not None
            if driver.is_closed():
                await conn.invalidate()
                continue
            await conn.execution_options(isolation_level="AUTOCOMMIT")
            yield conn, driver
            return


async def ping(engine: AsyncEngine) -> None:
    async with connection(engine) as conn:
        await conn.execute(_PING)


# Named queries this module runs through SQLAlchemy (the connectors run the others).
_PING = sa.text(sql.NAMED_TEXT["ping"])
