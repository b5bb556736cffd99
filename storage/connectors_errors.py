"""Each driver's errors in storage's own (:mod:`storage.errors`): asyncpg's SQLSTATEs and
connection failures, SQLite's messages, the operating system's refusals. Only storage's own
exceptions leave storage (``storage.database.translated``)."""

from __future__ import annotations

import asyncio
import re
import sqlite3

from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError, ProgrammingError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from compactd.storage.errors import (
    BadInput,
    CompactdError,
    DatabaseMissing,
    DatabaseUnavailable,
    DeadlinePassed,
    LockNotAvailable,
    SchemaMissing,
    SessionNotFound,
    StorageError,
)

_CD_NO_SESSION = "CD404"
_PG_UNDEFINED_TABLE = "42P01"
_PG_UNDEFINED_FUNCTION = "42883"
_PG_UNDEFINED_COLUMN = "42703"
_PG_NO_DATABASE = "3D000"
_PG_LOCK_NOT_AVAILABLE = "55P03"
_PG_QUERY_CANCELED = "57014"  # statement_timeout, or a cancel request
_PG_UNAVAILABLE_PREFIXES = ("08", "57P")
PG_READ_ONLY_TRANSACTION = "25006"  # a write on a standby


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


def storage_error(exc: BaseException, *, under_deadline: bool) -> CompactdError:
    """Storage's own exception for a driver error.

    Its message never carries the driver's text: that can quote the SQL, the values bound to it
    (message content) and server internals, and the message reaches HTTP bodies, CLI output and
    logs. It names the error's class and SQLSTATE, or the operating system's reason.
    ``under_deadline``: a cancelled statement or a lock timeout is the deadline's
    (``storage.database.deadline``).
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
        return DatabaseMissing(_missing_database(text))
    if under_deadline and (code == _PG_QUERY_CANCELED or (
            code == _PG_LOCK_NOT_AVAILABLE and "lock timeout" in text)):
        return DeadlinePassed()
    if code == _PG_LOCK_NOT_AVAILABLE or "could not obtain lock" in text:
        return LockNotAvailable()
    if isinstance(orig, sqlite3.OperationalError) and "locked" in text:
        return LockNotAvailable("the database is locked")
    return _unavailable(exc, orig, code, reason) or StorageError(f"database error: {reason}")


def _missing_database(text: str) -> str | None:
    """The name in the server's 3D000 message (``database "NAME" does not exist``), which is
    the operator's own URL, not data; None when the server words it otherwise (lc_messages)."""
    found = re.fullmatch(r'database "(.{1,63})" does not exist', text.strip())
    return found.group(1) if found else None


def _unavailable(exc: BaseException, orig: BaseException, code: str | None,
                 reason: str) -> DatabaseUnavailable | None:
    """The retryable error for a failure of the connection or of the server's role (a lost or
    refused connection, a server that refuses writes), or of the pool (no connection free in
    its time: they are all held, as by connections being opened to a server that does not
    answer), None for any other."""
    if isinstance(exc, PoolTimeout):
        return DatabaseUnavailable("no database connection was free in time (the pool's are "
                                   "all in use)")
    if (code and code.startswith(_PG_UNAVAILABLE_PREFIXES)) or isinstance(
            orig, ConnectionError | OSError) or "Connection refused" in str(orig):
        return DatabaseUnavailable(f"the database cannot be reached: {reason}")
    if isinstance(exc, InterfaceError) or _driver_interface_error(exc):
        return DatabaseUnavailable(f"the database connection failed: {reason}")
    if code == PG_READ_ONLY_TRANSACTION or _no_host_matches(exc):
        # A standby, or a primary being demoted: where the writable server is comes back after
        # the failover, on a new connection (the pool drops this one: connection_survives).
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
    if type(orig) is ConnectionError and str(orig):
        # The driver's own words on a connection it could not set up (asyncpg: the server
        # rejected the SSL upgrade sslmode=require asks for): its address, never a row's data.
        return f"{type(orig).__name__}: {str(orig)[:300]}"
    return type(orig).__name__ + (f" (SQLSTATE {code})" if code else "")


def is_driver_error(exc: BaseException) -> bool:
    """Whether ``exc`` is a driver's error: raised through SQLAlchemy's wrappers, by SQLite or
    the operating system, or by asyncpg and aiosqlite below SQLAlchemy (connection setup,
    protocol errors)."""
    if isinstance(exc, DBAPIError | OperationalError | ProgrammingError | sqlite3.Error
                  | OSError | PoolTimeout):
        return True
    return (type(exc).__module__ or "").startswith(("asyncpg", "aiosqlite"))


def connection_survives(exc: BaseException) -> bool:
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
        and sqlstate != PG_READ_ONLY_TRANSACTION
