"""Which errors leave the runtime's per-step PostgreSQL connection in place: a statement the
server refused or a cancelled one keep it, a failed connection does not, also when storage has
already translated the driver's error into its own."""

from __future__ import annotations

import asyncio

import asyncpg.exceptions as pg
import pytest

from compactd.storage.connectors_errors import connection_survives
from compactd.storage.database import translate
from compactd.storage.errors import (
    DatabaseMissing,
    DatabaseUnavailable,
    InvalidMessage,
    LockNotAvailable,
    SessionNotFound,
    StorageError,
)


def translated(driver: BaseException) -> BaseException:
    """What storage raises for ``driver``, chained the way ``raise ... from None`` leaves it."""
    try:
        try:
            raise driver
        except Exception as exc:
            raise translate(exc) from None
    except Exception as outer:
        return outer


@pytest.mark.parametrize("exc", [
    pg.LockNotAvailableError("lock timeout"),          # 55P03
    pg.QueryCanceledError("statement timeout"),        # 57014: the statement, not the server
    pg.UndefinedTableError("no table"),                # 42P01
    pg.UniqueViolationError("duplicate"),              # 23505
    InvalidMessage("bad tool link", field="tool_call_id"),
    SessionNotFound("ghost"),
    asyncio.CancelledError(),
])
def test_refused_and_cancelled_statements_keep_the_connection(exc: BaseException) -> None:
    assert connection_survives(exc)
    if isinstance(exc, pg.PostgresError):
        assert connection_survives(translated(exc))


@pytest.mark.parametrize("exc", [
    pg.AdminShutdownError("terminating connection"),   # 57P01
    pg.CannotConnectNowError("starting up"),           # 57P03
    pg.ProtocolViolationError("protocol"),             # 08P01
    pg.ConnectionDoesNotExistError("closed"),          # 08003
    pg.InterfaceError("another operation is in progress"),
    OSError("connection reset"),
    RuntimeError("unknown"),
])
def test_failed_connections_are_dropped(exc: BaseException) -> None:
    assert not connection_survives(exc)
    assert not connection_survives(translated(exc))


def test_a_translated_lock_timeout_still_counts_as_the_statement_s() -> None:
    exc = translated(pg.LockNotAvailableError("could not obtain lock"))
    assert isinstance(exc, LockNotAvailable | StorageError)
    assert connection_survives(exc)


def test_a_write_on_a_standby_is_an_unavailable_database_and_drops_the_connection() -> None:
    """During a failover a connection may reach a server that refuses writes (SQLSTATE 25006):
    a retryable DatabaseUnavailable, never a data error, and the connection is not reused (a
    new one finds the primary)."""
    exc = translated(pg.ReadOnlySQLTransactionError("cannot execute INSERT in a read-only "
                                                    "transaction"))
    assert isinstance(exc, DatabaseUnavailable) and "SQLSTATE 25006" in str(exc)
    assert not connection_survives(exc)
    assert not connection_survives(pg.ReadOnlySQLTransactionError("read-only"))


def test_no_writable_host_among_the_url_s_hosts_is_an_unavailable_database() -> None:
    """asyncpg's error when every host of a multi-host URL answered and none is the primary
    that target_session_attrs=read-write asks for (the standby before its promotion)."""
    exc = translated(pg.TargetServerAttributeNotMatched("None of the hosts match"))
    assert isinstance(exc, DatabaseUnavailable)
    assert "TargetServerAttributeNotMatched" in str(exc)


@pytest.mark.parametrize("exc", [
    pg.InterfaceError("connection is closed"),
    pg.ConnectionDoesNotExistError("connection was closed in the middle of operation"),
])
def test_a_connection_the_driver_lost_is_an_unavailable_database(exc: BaseException) -> None:
    """What a runtime or a worker holding a raw connection sees when the primary goes away
    under its statement: retryable, never a data error."""
    translated_exc = translated(exc)
    assert isinstance(translated_exc, DatabaseUnavailable) and translated_exc.retryable


def test_a_database_that_does_not_exist_is_not_retryable_and_is_named() -> None:
    """An operator's typo in the URL (3D000) does not heal with retries; a server that is
    starting up (57P03) does, and stays a retryable DatabaseUnavailable."""
    missing = translated(pg.InvalidCatalogNameError('database "compactd_typo" does not exist'))
    assert isinstance(missing, DatabaseMissing) and not missing.retryable
    assert not isinstance(missing, DatabaseUnavailable)
    assert "'compactd_typo' does not exist" in str(missing)
    # Worded otherwise (a server's lc_messages): still the error, without a name.
    reworded = translated(pg.InvalidCatalogNameError("la base n'existe pas"))
    assert isinstance(reworded, DatabaseMissing) and "n'existe" not in str(reworded)
    starting = translated(pg.CannotConnectNowError("the database system is starting up"))
    assert isinstance(starting, DatabaseUnavailable) and starting.retryable
