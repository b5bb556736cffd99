"""Each backend's engine, below its connector: the URLs it takes, how its engine is made, how
its transactions, reads and snapshots begin, and what opening it does to its schema.

:mod:`storage.database` runs these through :func:`backend_for_url` and :func:`backend_of`
and never asks which backend it is on. This module imports nothing of ``storage.database``,
which imports it.
"""

from __future__ import annotations

import abc
import contextlib
import random
import re
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from compactd.storage import sql
from compactd.storage.connectors_errors import PG_READ_ONLY_TRANSACTION
from compactd.storage.errors import ConfigError
from compactd.storage.recall_text import fold, snippet
from compactd.storage.schema import dumps

SQLITE_BUSY_TIMEOUT_MS = 30_000
READ_ONLY_OPTION = "compactd_read_only"
BUSY_TIMEOUT_OPTION = "compactd_busy_timeout_ms"
POOL_RECYCLE_S = 1800
# What one host of the URL has to accept a connection (TCP, TLS negotiation, authentication),
# unless the URL sets libpq's connect_timeout: a primary that stopped answering without refusing
# (a frozen host, a partition) must not hold every new connection for asyncpg's 60 s default,
# nor keep the next host of a failover URL from being tried.
CONNECT_TIMEOUT_S = 5.0
# The longest wait for a pooled connection when all are checked out (SQLAlchemy's default is
# 30 s): past it the caller gets the retryable DatabaseUnavailable, as for a lost connection.
# Above CONNECT_TIMEOUT_S, so a waiter outlasts a connection being opened for it.
POOL_TIMEOUT_S = 10.0


class Backend(abc.ABC):
    """What one backend does below its connector. Each backend implements every method (an
    abstract one left out fails at import, where the backends are made)."""

    #: The URL schemes it takes, each with the one that picks its async driver.
    schemes: tuple[tuple[str, str], ...]
    #: The execution options of a connection for reads of one statement each.
    read_options: Mapping[str, Any]
    #: The execution options of a connection whose transaction sees one consistent snapshot.
    snapshot_options: Mapping[str, Any]

    def takes(self, url: str) -> bool:
        return url.startswith(tuple(scheme for scheme, _ in self.schemes))

    def normalize(self, url: str) -> str:
        """``url`` with the async driver's scheme."""
        for scheme, driver in self.schemes:
            if url.startswith(scheme):
                return driver + url[len(scheme):]
        raise AssertionError(f"{type(self).__name__} does not take {url.split('://')[0]}://")

    @abc.abstractmethod
    def exists(self, url: str) -> bool:
        """Whether the database ``url`` names is there to open without creating it."""

    @abc.abstractmethod
    def create_engine(self, url: str, *, pool_size: int, max_overflow: int | None,
                      statement_cache: bool, echo: bool) -> AsyncEngine:
        """A new engine for ``url`` (in its driver's scheme): ``storage.database.create_engine``."""

    @abc.abstractmethod
    def bounded(self, conn: AsyncConnection, left_ms: int
                ) -> contextlib.AbstractAsyncContextManager[None]:
        """Begin ``conn``'s transaction with its lock waits and statements ending within
        ``left_ms``."""

    @abc.abstractmethod
    async def open_schema(self, engine: AsyncEngine, url: str) -> None:
        """What opening the database does to its schema (``storage.migrate.open_schema``)."""


class PostgresBackend(Backend):
    # Reads in autocommit: no BEGIN/ROLLBACK round trips around the statement.
    read_options = MappingProxyType({"isolation_level": "AUTOCOMMIT"})
    snapshot_options = MappingProxyType({"isolation_level": "REPEATABLE READ"})
    schemes = (
        ("postgres://", "postgresql+asyncpg://"),
        ("postgresql://", "postgresql+asyncpg://"),
        ("postgresql+psycopg2://", "postgresql+asyncpg://"),
        ("postgresql+psycopg://", "postgresql+asyncpg://"),
        ("postgresql+asyncpg://", "postgresql+asyncpg://"),
    )

    def normalize(self, url: str) -> str:
        return _hosts_as_query(super().normalize(url))

    def exists(self, url: str) -> bool:
        # Any server database: only ``migrate`` creates one, and opening it tells.
        return True

    def create_engine(self, url: str, *, pool_size: int, max_overflow: int | None,
                      statement_cache: bool, echo: bool) -> AsyncEngine:
        engine = create_async_engine(
            # No pool_pre_ping: it costs a round trip on every checkout, as much as a poll
            # itself. A connection that died is invalidated by SQLAlchemy when its error
            # surfaces (as DatabaseUnavailable) and the caller's retry gets a fresh one.
            url, echo=echo, json_serializer=dumps, pool_size=pool_size,
            max_overflow=pool_size if max_overflow is None else max_overflow,
            pool_recycle=POOL_RECYCLE_S, pool_timeout=POOL_TIMEOUT_S,
            connect_args={"server_settings": {"application_name": "compactd"},
                          "async_creator_fn": _connect_host_by_host,
                          **({} if statement_cache else _UNNAMED_STATEMENTS)},
        )
        event.listen(engine.sync_engine, "handle_error", _read_only_is_a_disconnect)
        return engine

    @contextlib.asynccontextmanager
    async def bounded(self, conn: AsyncConnection, left_ms: int) -> AsyncIterator[None]:
        async with conn.begin():
            await conn.execute(_SET_TIMEOUTS, {"ms": f"{left_ms}ms"})
            yield

    async def open_schema(self, engine: AsyncEngine, url: str) -> None:
        # A server's schema is its operator's: ``compactd migrate``, run before the workers.
        return None


class SQLiteBackend(Backend):
    # Reads take a deferred BEGIN (_configure_sqlite): never queued behind a writer, and in
    # WAL mode one snapshot for the whole transaction.
    read_options = MappingProxyType({READ_ONLY_OPTION: True})
    snapshot_options = read_options
    schemes = (
        ("sqlite://", "sqlite+aiosqlite://"),
        ("sqlite+aiosqlite://", "sqlite+aiosqlite://"),
    )

    def exists(self, url: str) -> bool:
        name = sa.engine.make_url(self.normalize(url)).database
        return not name or name == ":memory:" or Path(name).exists()

    def create_engine(self, url: str, *, pool_size: int, max_overflow: int | None,
                      statement_cache: bool, echo: bool) -> AsyncEngine:
        path = url.split(":///", 1)[1] if ":///" in url else ""
        if path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        engine = create_async_engine(
            url, echo=echo, json_serializer=dumps,
            connect_args={"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000, "isolation_level": None},
        )
        _configure_sqlite(engine)
        return engine

    @contextlib.asynccontextmanager
    async def bounded(self, conn: AsyncConnection, left_ms: int) -> AsyncIterator[None]:
        # SQLite has no statement timeout: the transaction waits for the write lock no longer
        # than it has left (its BEGIN, in _configure_sqlite, sets the busy timeout).
        await conn.execution_options(
            **{BUSY_TIMEOUT_OPTION: min(left_ms, SQLITE_BUSY_TIMEOUT_MS)})
        async with conn.begin():
            yield

    async def open_schema(self, engine: AsyncEngine, url: str) -> None:
        # The embedded file has no operator to run ``compactd migrate``: it is migrated to head
        # when it is behind. Imported here: storage.migrate imports storage.database, which
        # imports this module.
        from compactd.storage.migrate import ensure_schema

        await ensure_schema(engine, url)


_BACKENDS: tuple[Backend, ...] = (PostgresBackend(), SQLiteBackend())
_BY_DIALECT: dict[str, Backend] = {"postgresql": _BACKENDS[0], "sqlite": _BACKENDS[1]}


def backend_for_url(url: str) -> Backend:
    """The backend a database URL names; ConfigError (bad input) for a scheme none takes."""
    for backend in _BACKENDS:
        if backend.takes(url):
            return backend
    if "://" not in url:
        # Never the text itself: a URL without its scheme still holds its password.
        raise ConfigError("database URL: no scheme (use postgresql://... or sqlite:///...)")
    raise ConfigError(
        f"unsupported database URL {url.split('://')[0]}:// (use postgresql:// or sqlite:///)")


def backend_of(engine: AsyncEngine | AsyncConnection) -> Backend:
    """The backend an engine (or one of its connections) runs on."""
    return _BY_DIALECT[engine.dialect.name]


# What follows ``scheme://``, split as SQLAlchemy's URL parser splits it: a user name holds no
# ``:`` or ``/``, a password no ``@`` (so it may hold ``/``, ``?`` and ``+`` unencoded, as generated
# passwords do), then the hosts up to the path or the query.
_AUTHORITY = re.compile(r"(?:(?P<credentials>[^:/@]*(?::[^@]*)?)(?P<at>@))?"
                        r"(?P<hosts>[^/?]*)(?P<tail>.*)", re.DOTALL)


def _hosts_as_query(url: str) -> str:
    """libpq's multi-host form (``user@h1:5432,h2:5432/db?target_session_attrs=read-write``) in
    the form SQLAlchemy's asyncpg dialect reads (``user@/db?host=h1:5432&host=h2:5432&...``),
    which hands asyncpg the host list; asyncpg tries them in order and, with
    ``target_session_attrs``, keeps the first that is what it asks for (read-write: the
    primary). A URL of one host is returned as it is."""
    scheme, rest = url.split("://", 1)
    parts = _AUTHORITY.match(rest)
    assert parts is not None  # every part of the pattern may be empty
    credentials, at = parts["credentials"] or "", parts["at"] or ""
    hosts, tail = parts["hosts"], parts["tail"]
    path, _, query = tail.removeprefix("/").partition("?")
    _check_hosts(hosts)
    _check_query(query)
    if "," not in hosts:
        return url
    params = "&".join(f"host={host}" for host in hosts.split(","))
    return f"{scheme}://{credentials}{at}/{path}?{params}{'&' + query if query else ''}"


# What asyncpg takes as target_session_attrs (it refuses any other at every connection, as a
# connection error that reads like an unreachable server).
SESSION_ATTRS = ("any", "primary", "standby", "prefer-standby", "read-write", "read-only")
# libpq's sslmode values, which asyncpg's ssl takes as they are.
SSL_MODES = ("disable", "allow", "prefer", "require", "verify-ca", "verify-full")
# The URL options that reach a connection: SQLAlchemy hands every other one to asyncpg's
# connect as a keyword it does not take, a TypeError at every connection. libpq's sslmode,
# connect_timeout and application_name are read by _connect_host_by_host; host and port are
# the multi-host form's (_hosts_as_query); prepared_statement_cache_size is SQLAlchemy's.
URL_OPTIONS = ("host", "port", "user", "password", "passfile", "database", "service",
               "servicefile", "ssl", "sslmode", "target_session_attrs", "connect_timeout",
               "application_name", "krbsrvname", "gsslib", "prepared_statement_cache_size",
               "load_balance_hosts")
# libpq's load_balance_hosts: ``disable`` (its default) tries the hosts in the URL's order,
# ``random`` in an order drawn afresh for each connection.
LOAD_BALANCE = ("disable", "random")


def _check_hosts(hosts: str) -> None:
    """Refuse, naming it, a host list with an empty host or a port that is not a TCP port: the
    driver would fail on it with a traceback, or at every connection."""
    for host in hosts.split(",") if hosts else ():
        if not host:
            raise ConfigError("database URL: an empty host in the host list")
        name, colon, port = host.rpartition(":") if not host.endswith("]") else ("", "", "")
        if colon and port and not name.endswith(":") and not (port.isdigit()
                                                              and 1 <= int(port) <= 65535):
            raise ConfigError(f"database URL: the port of host {name or host!r} must be a "
                              f"number from 1 to 65535, not {port!r}")


def _check_query(query: str) -> None:
    """Refuse, naming it, an option no connection could use: one the driver does not take, or
    a target_session_attrs, an sslmode, a load_balance_hosts or a connect_timeout (libpq's, per
    host: :func:`_connect_host_by_host`) of a value it cannot use."""
    for key, _, value in (item.partition("=") for item in query.split("&") if item):
        if key not in URL_OPTIONS:
            raise ConfigError(f"database URL: {key!r} is not an option compactd can pass to "
                              f"the driver (it takes {', '.join(URL_OPTIONS)})")
        if key in ("ssl", "sslmode") and value not in SSL_MODES:
            raise ConfigError(f"database URL: {key} must be one of {', '.join(SSL_MODES)}, "
                              f"not {value!r}")
        if key == "target_session_attrs" and value not in SESSION_ATTRS:
            raise ConfigError(f"database URL: target_session_attrs must be one of "
                              f"{', '.join(SESSION_ATTRS)}, not {value!r}")
        if key == "load_balance_hosts" and value not in LOAD_BALANCE:
            raise ConfigError(f"database URL: load_balance_hosts must be one of "
                              f"{', '.join(LOAD_BALANCE)}, not {value!r}")
        if key == "connect_timeout" and not _positive_seconds(value):
            raise ConfigError(f"database URL: connect_timeout must be a positive number of "
                              f"seconds, not {value!r}")


def _positive_seconds(value: str) -> bool:
    try:
        return 0 < float(value) < float("inf")
    except ValueError:
        return False


async def _connect_host_by_host(*args: Any, host: Any = None, port: Any = None,
                                target_session_attrs: str | None = None,
                                connect_timeout: str | float | None = None,
                                sslmode: str | None = None, application_name: str | None = None,
                                load_balance_hosts: str | None = None, **kwargs: Any) -> Any:
    """asyncpg's connect, each host of the URL with its own time to answer, as libpq's
    ``connect_timeout`` is per host: asyncpg's ``timeout`` bounds all its hosts together, so a
    first host that never answers (an old primary that hangs instead of refusing) spends it
    all and the next host, the new primary, is never tried. The hosts are tried as libpq tries
    them: in the URL's order, or in a random one with ``load_balance_hosts=random``; the first
    that accepts and is what ``target_session_attrs`` asks for is kept (prefer-standby: the
    first standby, else the first that accepts, as libpq's second pass "in any mode"; asyncpg's
    own prefer-standby takes a random one of those, which no URL asked for). As asyncpg, a
    host that refuses, times out or is not ready passes to the next; any other error (a wrong
    password) is raised. libpq's ``sslmode`` is asyncpg's ``ssl``; its ``application_name``
    replaces compactd's own in the server settings."""
    import asyncpg

    if sslmode is not None:
        kwargs.setdefault("ssl", sslmode)
    if application_name is not None:
        kwargs["server_settings"] = {**kwargs.get("server_settings", {}),
                                     "application_name": application_name}
    timeout = CONNECT_TIMEOUT_S if connect_timeout is None else float(connect_timeout)
    hosts = host if isinstance(host, list) else [host]
    ports = port if isinstance(port, list) else [port] * len(hosts)
    order = list(zip(hosts, ports, strict=True))
    if load_balance_hosts == "random":
        # Each connection its own order: a fleet's connections spread over the hosts.
        random.shuffle(order)
    passes = ["standby", "any"] if target_session_attrs == "prefer-standby" \
        else [target_session_attrs]
    failed: BaseException | None = None
    unreachable: set[int] = set()  # not tried again by prefer-standby's second pass
    for attrs in passes:
        for i, (one_host, one_port) in enumerate(order):
            if i in unreachable:
                continue
            try:
                return await asyncpg.connect(*args, host=one_host, port=one_port,
                                             timeout=timeout, target_session_attrs=attrs,
                                             **kwargs)
            except (OSError, asyncpg.CannotConnectNowError) as exc:  # TimeoutError too
                failed = exc
                unreachable.add(i)
            except asyncpg.TargetServerAttributeNotMatched as exc:
                failed = failed or exc
    assert failed is not None
    raise failed


def _read_only_is_a_disconnect(context: Any) -> None:
    """A pooled connection whose server refuses writes (a primary demoted to a standby) is
    dropped with the rest of the pool, as a lost connection is: new connections go to the
    server that is the primary now (target_session_attrs=read-write)."""
    if getattr(context.original_exception, "sqlstate", None) == PG_READ_ONLY_TRANSACTION:
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


_SET_TIMEOUTS = sa.text(sql.NAMED_TEXT["set_timeouts"])
