"""A lock another connection holds, for tests of what the store does while it waits."""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import AsyncIterator

import asyncpg


@contextlib.asynccontextmanager
async def session_row_locked(db_url: str, session_id: str) -> AsyncIterator[None]:
    """The session's row (PostgreSQL) or the database's write lock (SQLite), held by another
    connection for the block."""
    if db_url.startswith("sqlite"):
        other = sqlite3.connect(db_url.split(":///", 1)[1], isolation_level=None)
        other.execute("BEGIN IMMEDIATE")
        try:
            yield
        finally:
            other.execute("ROLLBACK")
            other.close()
        return
    conn = await asyncpg.connect(db_url)
    try:
        async with conn.transaction():
            await conn.execute("SELECT 1 FROM sessions WHERE id = $1 FOR UPDATE", session_id)
            yield
    finally:
        await conn.close()
