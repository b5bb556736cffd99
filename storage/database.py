"""Engines, transactions and the translation of driver errors.

PostgreSQL is reached through asyncpg; the embedded default is a SQLite file through aiosqlite.
Every transaction here is short: none is ever held open across a model call.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import os
import sqlite3
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError, ProgrammingError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from compactd.storage import sql
from compactd.storage.errors import (
    BadInput,
    CompactdError,
    DatabaseUnavailable,
    DeadlinePassed,
    LockNotAvailable,
    SchemaMissing,
    SessionNotFound,
    StorageError,
)
from compactd.storage.recall_text import fold, snippet
from compactd.storage.schema import dumps

SQLITE_FILENAME = "compactd.sqlite3"
SQLITE_BUSY_TIMEOUT_MS = 30_000
READ_ONLY_OPTION = "compactd_read_only"
BUSY_TIMEOUT_OPTION = "compactd_busy_timeout_ms"
POOL_RECYCLE_S = 1800

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
    if not is_sqlite(url):
        return True
    name = sa.engine.make_url(normalize_url(url)).database
    return not name or name == ":memory:" or Path(name).exists()


def normalize_url(url: str) -> str:
    """Accept the URLs people write and pick the async driver for them."""
    for prefix, replacement in (
        ("postgres://", "postgresql+asyncpg://"),
        ("postgresql://", "postgresql+asyncpg://"),
        ("postgresql+psycopg2://", "postgresql+asyncpg://"),
        ("postgresql+psycopg://", "postgresql+asyncpg://"),
        ("sqlite://", "sqlite+aiosqlite://"),
    ):
        if url.startswith(prefix):
            return _hosts_as_query(replacement + url[len(prefix):])
    if url.startswith("postgresql+asyncpg://"):
        return _hosts_as_query(url)
    if url.startswith("sqlite+aiosqlite://"):
        return url
    raise CompactdError(
        f"unsupported database URL {url.split('://')[0]}:// (use postgresql:// or sqlite:///)")


def _hosts_as_query(url: str) -> str:
    """libpq's multi-host form (``user@h1:5432,h2:5432/db?target_session_attrs=read-write``) in
    the form SQLAlchemy's asyncpg dialect reads (``user@/db?host=h1:5432&host=h2:5432&...``),
    which hands asyncpg the host list; asyncpg tries them in order and, with
    ``target_session_attrs``, keeps the first that is what it asks for (read-write: the
    primary). A URL of one host is returned as it is."""
    scheme, rest = url.split("://", 1)
    authority, _, tail = rest.partition("/")
    credentials, at, hosts = authority.rpartition("@")
    if "," not in hosts:
        return url
    if not all(hosts.split(",")):
        raise CompactdError("database URL: an empty host in the host list")
    path, _, query = tail.partition("?")
    params = "&".join(f"host={host}" for host in hosts.split(","))
    return f"{scheme}://{credentials}{at}/{path}?{params}{'&' + query if query else ''}"


def is_sqlite(engine_or_url: AsyncEngine | str) -> bool:
    url = engine_or_url if isinstance(engine_or_url, str) else str(engine_or_url.url)
    return url.startswith("sqlite")


def create_engine(url: str, *, pool_size: int = 10, max_overflow: int | None = None,
                  statement_cache: bool = True, echo: bool = False) -> AsyncEngine:
    """An async engine for ``url``; create one per process and per event loop, never share it.

    On PostgreSQL it keeps ``pool_size`` connections and opens up to ``max_overflow`` more
    (default: as many again) for bursts, closing those on return. ``statement_cache=False``
    (``database.statement_cache``) prepares nothing by name, for a pooler in transaction mode
    that hands a connection's statements to any server connection."""
    url = normalize_url(url)
    if url.startswith("sqlite"):
        path = url.split(":///", 1)[1] if ":///" in url else ""
        if path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        engine = create_async_engine(
            url, echo=echo, json_serializer=dumps,
            connect_args={"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000, "isolation_level": None},
        )
        _configure_sqlite(engine)
        return engine
    engine = create_async_engine(
        # No pool_pre_ping: it costs a round trip on every checkout, as much as a poll itself.
        # A connection that died is invalidated by SQLAlchemy when its error surfaces (as
        # DatabaseUnavailable) and the caller's retry gets a fresh one.
        url, echo=echo, json_serializer=dumps, pool_size=pool_size,
        max_overflow=pool_size if max_overflow is None else max_overflow,
        pool_recycle=POOL_RECYCLE_S,
        connect_args={"server_settings": {"application_name": "compactd"},
                      **({} if statement_cache else _UNNAMED_STATEMENTS)},
    )
    event.listen(engine.sync_engine, "handle_error", _read_only_is_a_disconnect)
    return engine


def _read_only_is_a_disconnect(context: Any) -> None:
    """A pooled connection whose server refuses writes (a primary demoted to a standby) is
    dropped with the rest of the pool, as a lost connection is: new connections go to the
    server that is the primary now (target_session_attrs=read-write)."""
    if getattr(context.original_exception, "sqlstate", None) == _PG_READ_ONLY_TRANSACTION:
        context.is_disconnect = True


def _unnamed() -> str:
    # asyncpg reads an empty name as the unnamed statement: without a statement cache it is
    # parsed again in the same message as its execution, so it never outlives one round trip.
    return ""


# Neither asyncpg's statement cache (the raw connections' named queries) nor SQLAlchemy's
# (its dialect prepares every statement it runs, by a generated name) keeps anything.
_UNNAMED_STATEMENTS: dict[str, Any] = {
    "statement_cache_size": 0, "prepared_statement_cache_size": 0,
    "prepared_statement_name_func": _unnamed}


def _configure_sqlite(engine: AsyncEngine) -> None:
    # pysqlite's own transaction handling starts transactions lazily and as DEFERRED, so two
    # writers can both read and then deadlock on upgrade. Taking over BEGIN makes every
    # transaction IMMEDIATE: writers queue on the busy timeout instead of failing.
    sync_engine = engine.sync_engine

    @event.listens_for(sync_engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        cursor = dbapi_conn.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        cursor.close()
        # Recall's searches compare text as PostgreSQL's do (storage.recall_text): SQLite's
        # lower() folds ASCII only, and its substr() stops at a NUL.
        dbapi_conn.create_function("compactd_fold", 1, fold, deterministic=True)
        dbapi_conn.create_function("compactd_snippet", 4, snippet, deterministic=True)

    @event.listens_for(sync_engine, "begin")
    def _on_begin(conn: Any) -> None:
        options = conn.get_execution_options()
        # A transaction under a deadline waits for the write lock no longer than it has left;
        # the next one on this connection gets the default back.
        busy_ms = options.get(BUSY_TIMEOUT_OPTION) or SQLITE_BUSY_TIMEOUT_MS
        if conn.info.get(BUSY_TIMEOUT_OPTION, SQLITE_BUSY_TIMEOUT_MS) != busy_ms:
            conn.exec_driver_sql(f"PRAGMA busy_timeout={int(busy_ms)}")
            conn.info[BUSY_TIMEOUT_OPTION] = busy_ms
        # Reads take a plain deferred BEGIN so they never queue behind a writer (WAL lets
        # them read the last committed state).
        read_only = options.get(READ_ONLY_OPTION, False)
        conn.exec_driver_sql("BEGIN" if read_only else "BEGIN IMMEDIATE")


_CD_NO_SESSION = "CD404"
_PG_UNDEFINED_TABLE = "42P01"
_PG_UNDEFINED_FUNCTION = "42883"
_PG_UNDEFINED_COLUMN = "42703"
_PG_NO_DATABASE = "3D000"
_PG_LOCK_NOT_AVAILABLE = "55P03"
_PG_QUERY_CANCELED = "57014"  # statement_timeout, or a cancel request
_PG_UNAVAILABLE_PREFIXES = ("08", "57P")
_PG_READ_ONLY_TRANSACTION = "25006"  # a write on a standby


def driver_error(exc: BaseException) -> BaseException:
    """The asyncpg exception under SQLAlchemy's wrappers, or under storage's own error raised
    for it (``raise ... from None`` leaves it as the context): it carries ``sqlstate`` and
    ``detail`` (SQLAlchemy 2.0's adapter error copies only the SQLSTATE). ``exc`` itself when
    there is none (SQLite, or an error raised before the driver)."""
    seen: BaseException | None = exc
    for _ in range(4):
        if seen is None:
            break
        if (type(seen).__module__ or "").startswith("asyncpg"):
            return seen
        seen = getattr(seen, "orig", None) or seen.__cause__ or seen.__context__
    return exc


def translate(exc: BaseException) -> CompactdError:
    """Storage's own exception for a driver error.

    Its message never carries the driver's text: that can quote the SQL, the values bound to it
    (message content) and server internals, and the message reaches HTTP bodies, CLI output and
    logs. It names the error's class and SQLSTATE, or the operating system's reason.
    """
    orig = getattr(exc, "orig", None) or exc
    code = getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)
    text = str(orig)
    reason = _reason(orig, code)
    if code == _CD_NO_SESSION:
        # compactd's SQL functions raise this with the session id as DETAIL.
        return SessionNotFound(str(getattr(driver_error(exc), "detail", None) or ""))
    if code == _PG_UNDEFINED_TABLE or "no such table" in text:
        return SchemaMissing()
    if code == _PG_UNDEFINED_FUNCTION and "compactd_" in text:
        # The code is newer than the schema: one of compactd's SQL functions is missing.
        return SchemaMissing("the database schema is older than this compactd (one of its SQL "
                             "functions is missing): run `compactd migrate`")
    if code == _PG_UNDEFINED_COLUMN or "no such column" in text:
        # compactd's own statements name only columns its migrations create: the schema is older.
        return SchemaMissing("the database schema is older than this compactd (a column is"
                             " missing): run `compactd migrate`")
    if code == _PG_NO_DATABASE:
        return DatabaseUnavailable("the database does not exist: create it (createdb) before "
                                   "`compactd migrate`")
    if _DEADLINE.get() is not None and (code == _PG_QUERY_CANCELED or (
            code == _PG_LOCK_NOT_AVAILABLE and "lock timeout" in text)):
        return DeadlinePassed()
    if code == _PG_LOCK_NOT_AVAILABLE or "could not obtain lock" in text:
        return LockNotAvailable()
    if isinstance(orig, sqlite3.OperationalError) and "locked" in text:
        return LockNotAvailable("the database is locked")
    return _unavailable(exc, orig, code, reason) or StorageError(f"database error: {reason}")


def _unavailable(exc: BaseException, orig: BaseException, code: str | None,
                 reason: str) -> DatabaseUnavailable | None:
    """The retryable error for a failure of the connection or of the server's role (a lost or
    refused connection, a server that refuses writes), None for any other."""
    if (code and code.startswith(_PG_UNAVAILABLE_PREFIXES)) or isinstance(
            orig, ConnectionError | OSError) or "Connection refused" in str(orig):
        return DatabaseUnavailable(f"the database cannot be reached: {reason}")
    if isinstance(exc, InterfaceError) or _driver_interface_error(exc):
        return DatabaseUnavailable(f"the database connection failed: {reason}")
    if code == _PG_READ_ONLY_TRANSACTION or _no_host_matches(exc):
        # A standby, or a primary being demoted: where the writable server is comes back after
        # the failover, on a new connection (the pool drops this one: _connection_survives).
        return DatabaseUnavailable(f"no writable database (a failover?): {reason}")
    return None


def _driver_interface_error(exc: BaseException) -> bool:
    """Whether asyncpg itself failed on the connection (its InterfaceError: the connection was
    closed under the statement, as a server that went away leaves it), below SQLAlchemy."""
    driver = driver_error(exc)
    return (type(driver).__module__ or "").startswith("asyncpg") and any(
        cls.__name__ == "InterfaceError" for cls in type(driver).__mro__)


def _no_host_matches(exc: BaseException) -> bool:
    """Whether asyncpg reached none of the hosts of the URL that is what target_session_attrs
    asks for (read-write: every one answered, none is a primary; during a failover)."""
    return type(driver_error(exc)).__name__ == "TargetServerAttributeNotMatched"


def _reason(orig: BaseException, code: str | None) -> str:
    """What may be said of a driver error: the OS's reason for a failed connection, else the
    error's class and SQLSTATE."""
    if isinstance(orig, OSError) and orig.strerror:
        return orig.strerror
    return type(orig).__name__ + (f" (SQLSTATE {code})" if code else "")


@contextlib.contextmanager
def translated() -> Any:
    """Turn any driver error raised inside into storage's own exception."""
    try:
        yield
    except CompactdError:
        raise
    except (DBAPIError, OperationalError, ProgrammingError, sqlite3.Error, OSError) as exc:
        raise translate(exc) from exc
    except Exception as exc:
        # asyncpg raises its own exception classes when it fails below SQLAlchemy's wrapper
        # (connection setup, protocol errors); they are all driver errors to the caller.
        module = type(exc).__module__ or ""
        if module.startswith(("asyncpg", "aiosqlite")):
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
        async with engine.connect() as conn:
            sqlite = engine.dialect.name == "sqlite"
            if sqlite:
                await conn.execution_options(
                    **{BUSY_TIMEOUT_OPTION: min(left_ms, SQLITE_BUSY_TIMEOUT_MS)})
            async with conn.begin():
                if not sqlite:
                    await conn.execute(_SET_TIMEOUTS, {"ms": f"{left_ms}ms"})
                yield conn


@contextlib.asynccontextmanager
async def connection(engine: AsyncEngine) -> AsyncIterator[AsyncConnection]:
    """A connection for reads of one statement each: no BEGIN/ROLLBACK round trips on
    PostgreSQL (autocommit), and never queued behind a writer on SQLite."""
    with translated():
        async with engine.connect() as conn:
            if engine.dialect.name == "sqlite":
                await conn.execution_options(**{READ_ONLY_OPTION: True})
            else:
                await conn.execution_options(isolation_level="AUTOCOMMIT")
            yield conn


@contextlib.asynccontextmanager
async def snapshot(engine: AsyncEngine) -> AsyncIterator[AsyncConnection]:
    """A connection whose statements all see one consistent snapshot (multi-statement reads)."""
    with translated():
        async with engine.connect() as conn:
            if engine.dialect.name == "sqlite":
                await conn.execution_options(**{READ_ONLY_OPTION: True})
            else:
                await conn.execution_options(isolation_level="REPEATABLE READ")
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
                if driver.is_closed() or not _connection_survives(exc):
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
                    if kept.raw.is_closed() or not _connection_survives(exc):
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


def _connection_survives(exc: BaseException) -> bool:
    """Whether the connection is as good as before after ``exc`` left a statement on it: the
    caller refused the input, the statement was cancelled, by the task or by its deadline
    (asyncpg cancels it on the server and the next statement waits for that), or the server
    refused the statement itself (any SQLSTATE but the connection and shutdown classes, 08 and
    57P), also when the caller has translated the driver's error already."""
    if isinstance(exc, BadInput | DeadlinePassed | asyncio.CancelledError):
        return True
    from asyncpg import PostgresError  # imported here: only a failing statement needs it

    driver = driver_error(exc)
    sqlstate = (getattr(driver, "sqlstate", None) or "") if isinstance(driver, PostgresError) \
        else None
    # A server that refuses writes stays a standby: a new connection finds the primary.
    return sqlstate is not None and not sqlstate.startswith(_PG_UNAVAILABLE_PREFIXES) \
        and sqlstate != _PG_READ_ONLY_TRANSACTION


async def ping(engine: AsyncEngine) -> None:
    async with connection(engine) as conn:
        await conn.execute(_PING)


# Named queries this module runs through SQLAlchemy (the connectors run the others).
_SET_TIMEOUTS = sa.text(sql.NAMED_TEXT["set_timeouts"])
_PING = sa.text(sql.NAMED_TEXT["ping"])
