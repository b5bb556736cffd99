"""PostgreSQL's connector runs its named queries on asyncpg connections, around SQLAlchemy's
statement layer: one a pooled connection lends (:func:`raw_connection`), or one of those a
process keeps checked out for the queries it runs over and over (:class:`KeptConnections`)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from compactd.storage.connectors_engines import POOL_RECYCLE_S
from compactd.storage.connectors_errors import connection_survives
from compactd.storage.database import cancelled_at_deadline, translated


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
                async with cancelled_at_deadline():
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
                    async with cancelled_at_deadline():
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
