"""The two backends behind one interface: where PostgreSQL and SQLite differ, and nowhere else.

A connector runs the named queries of ``storage/sql`` and owns what one backend can do that the
other cannot. :class:`PostgresConnector` runs them on asyncpg connections of the engine's pool
(autocommit, one statement each, on a :class:`KeptConnections` connection when one is free) and
does the append, the free claim and the commit in one call of compactd's SQL functions.
:class:`SQLiteConnector` runs the portable queries through SQLAlchemy on the embedded file, and
has no SQL functions: its ``*_call`` methods return None, and the store does that work with the
general statements in its own transaction, which are the same on both backends.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
from collections.abc import AsyncIterator, Mapping
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from storage import schema as t
from storage import sql
from storage.database import (
    KeptConnections,
    connection,
    is_sqlite,
    transaction,
)

Row = Mapping[Any, Any]


class Connector:
    """The named queries of ``storage/sql``, and the operations one backend runs in one call.

    ``conn``: run inside that SQLAlchemy transaction instead of on a connection of its own.
    """

    engine: AsyncEngine
    #: The append sends the batch as JSON text (:func:`storage.store.prepare_append`).
    encodes_appends: bool
    #: A claim waits for the session's row lock (PostgreSQL), rather than the database's.
    locks_rows: bool
    #: Writes a batch of rows as array parameters in one statement (PostgreSQL).
    takes_arrays: bool
    #: The suffix of this backend's form of a query the two spell differently.
    variant_suffix: str

    def variant(self, name: str) -> str:
        """This backend's form of query ``name`` (``<name>_pg`` or ``<name>_sqlite`` in
        storage/sql)."""
        return f"{name}_{self.variant_suffix}"

    async def fetch(self, name: str, *, conn: AsyncConnection | None = None,
                    **params: Any) -> list[Row]:
        raise NotImplementedError

    async def fetchrow(self, name: str, *, conn: AsyncConnection | None = None,
                       **params: Any) -> Row | None:
        rows = await self.fetch(name, conn=conn, **params)
        return rows[0] if rows else None

    async def fetchval(self, name: str, *, conn: AsyncConnection | None = None,
                       **params: Any) -> Any:
        row = await self.fetchrow(name, conn=conn, **params)
        return None if row is None else next(iter(row.values()))

    async def execute(self, name: str, *, conn: AsyncConnection | None = None,
                      **params: Any) -> int:
        """Run a write; the rows it changed."""
        raise NotImplementedError

    async def execute_many(self, name: str, *, conn: AsyncConnection,
                           rows: list[dict[str, Any]]) -> None:
        """Run a write once per parameter set of ``rows``, inside ``conn``'s transaction."""
        if rows:
            await conn.execute(self._text(name), rows)

    def _text(self, name: str) -> Any:
        raise NotImplementedError

    def insert(self, table: sa.Table) -> Any:
        """``INSERT`` with the dialect's ``ON CONFLICT`` clauses."""
        raise NotImplementedError

    async def close(self) -> None:
        """Give back what the connector holds (the engine is its owner's to dispose of)."""

    async def wait_for_row_lock(self, conn: AsyncConnection, wait_s: float) -> None:
        """Bound the wait for row locks for the rest of ``conn``'s transaction."""

    async def plan_for_each_search(self, conn: AsyncConnection) -> None:
        """Plan the searches in the rest of ``conn``'s transaction for their own values, not
        once for any value (the query ``plan_for_each_search`` says why)."""

    async def append_call(self, **params: Any) -> Row | None:
        """The append in one call (``append`` in queries.sql); None: not on this backend."""
        return None

    async def claim_call(self, **params: Any) -> Row | None:
        """The free claim in one call (``claim_free``); None: not on this backend."""
        return None

    async def commit_call(self, name: str, **params: Any) -> Row | None:
        """The commit in one call (``commit`` or ``commit_ending``); None: not on this
        backend."""
        return None


class PostgresConnector(Connector):
    """Named queries on asyncpg connections: aiosql loaded their text and parameter order once,
    and asyncpg runs them directly (its statement cache prepares each once per connection)."""

    encodes_appends = True
    locks_rows = True
    takes_arrays = True
    variant_suffix = "pg"

    def __init__(self, engine: AsyncEngine, *, kept: int = 1) -> None:
        self.engine = engine
        self._kept = KeptConnections(engine, kept)

    async def close(self) -> None:
        await self._kept.close()

    async def fetch(self, name: str, *, conn: AsyncConnection | None = None,
                    **params: Any) -> list[Row]:
        if conn is not None:
            return [r._mapping for r in await conn.execute(_named_text(name), params)]
        text, args = _positional(name, params)
        async with self._kept.use() as raw:
            rows: list[Row] = await raw.fetch(text, *args)
            return rows

    async def fetchrow(self, name: str, *, conn: AsyncConnection | None = None,
                       **params: Any) -> Row | None:
        if conn is not None:
            return await super().fetchrow(name, conn=conn, **params)
        text, args = _positional(name, params)
        async with self._kept.use() as raw:
            row: Row | None = await raw.fetchrow(text, *args)
            return row

    async def fetchval(self, name: str, *, conn: AsyncConnection | None = None,
                       **params: Any) -> Any:
        if conn is not None:
            return await super().fetchval(name, conn=conn, **params)
        text, args = _positional(name, params)
        async with self._kept.use() as raw:
            return await raw.fetchval(text, *args)

    async def execute(self, name: str, *, conn: AsyncConnection | None = None,
                      **params: Any) -> int:
        if conn is not None:
            return int((await conn.execute(_named_text(name), params)).rowcount)
        text, args = _positional(name, params)
        async with self._kept.use() as raw:
            status: str = await raw.execute(text, *args)
        return int(status.rsplit(" ", 1)[-1])

    def insert(self, table: sa.Table) -> Any:
        return pg_insert(table)

    def _text(self, name: str) -> Any:
        return _named_text(name)

    async def wait_for_row_lock(self, conn: AsyncConnection, wait_s: float) -> None:
        await self.execute("set_lock_wait", conn=conn, ms=f"{max(1, int(wait_s * 1000))}ms")

    async def plan_for_each_search(self, conn: AsyncConnection) -> None:
        await self.execute("plan_for_each_search", conn=conn)

    async def append_call(self, **params: Any) -> Row | None:
        return await self.fetchrow("append", **params)

    async def claim_call(self, **params: Any) -> Row | None:
        return await self.fetchrow("claim_free", **params)

    async def commit_call(self, name: str, **params: Any) -> Row | None:
        return await self.fetchrow(name, **params)


class SQLiteConnector(Connector):
    encodes_appends = False
    locks_rows = False
    takes_arrays = False
    variant_suffix = "sqlite"

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    async def fetch(self, name: str, *, conn: AsyncConnection | None = None,
                    **params: Any) -> list[Row]:
        async with self._connection(name, conn) as c:
            return [r._mapping for r in await c.execute(_sqlite_text(name, *_typed(params)),
                                                        params)]

    async def execute(self, name: str, *, conn: AsyncConnection | None = None,
                      **params: Any) -> int:
        async with self._connection(name, conn) as c:
            result = await c.execute(_sqlite_text(name, *_typed(params)), params)
            return int(result.rowcount)

    def insert(self, table: sa.Table) -> Any:
        return sqlite_insert(table)

    def _text(self, name: str) -> Any:
        return _sqlite_text(name)

    @contextlib.asynccontextmanager
    async def _connection(self, name: str, conn: AsyncConnection | None
                          ) -> AsyncIterator[AsyncConnection]:
        if conn is not None:
            yield conn
        elif sql.writes(name):
            async with transaction(self.engine) as c:
                yield c
        else:
            async with connection(self.engine) as c:
                yield c


def connector_for(engine: AsyncEngine, *, kept: int = 1) -> Connector:
    """The engine's connector; on PostgreSQL it keeps up to ``kept`` connections for the named
    queries (see :class:`KeptConnections`)."""
    return SQLiteConnector(engine) if is_sqlite(engine) else PostgresConnector(engine, kept=kept)



def _positional(name: str, params: Mapping[str, Any]) -> tuple[str, list[Any]]:
    """Query ``name`` for asyncpg: its ``$n`` text and ``params`` in its parameters' order."""
    text, order = sql.positional(name)
    return text, [params[p] for p in order]


# Result columns typed by name, from the tables: SQLite returns datetimes and JSON as text.
_RESULT_TYPES: dict[str, Any] = {
    c.name: c.type for table in t.metadata.tables.values() for c in table.c
    if isinstance(c.type, sa.JSON | t.UTCDateTime)}


def _typed(params: Mapping[str, Any]) -> tuple[str, ...]:
    """The parameters bound as aware UTC datetimes (stored naive on SQLite)."""
    return tuple(sorted(k for k, v in params.items() if isinstance(v, dt.datetime)))


@functools.cache
def _sqlite_text(name: str, *datetimes: str) -> Any:
    text = sa.text(sql.sqlite_text(name)).bindparams(
        *(sa.bindparam(p, type_=t.UTCDateTime) for p in datetimes))
    return text.columns(**_RESULT_TYPES) if sql.returns_rows(name) else text


@functools.cache
def _named_text(name: str) -> Any:
    """A query as SQLAlchemy text, for a statement inside a transaction on PostgreSQL."""
    return sa.text(sql.postgres_text(name))
