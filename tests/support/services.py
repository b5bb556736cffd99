"""Small helpers for the real services the tests and benchmarks use: PostgreSQL databases of
their own, and Redis databases they may empty (never the whole server)."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from urllib.parse import urlparse

# ops/test installs the Debian packages some tests need (chromium, pgbouncer, the server's
# binaries, docker-compose) in the background while the tests run, and names a file it creates
# when that install has ended, whether it installed them or not.
APT_DONE_ENV = "COMPACTD_TEST_APT_DONE"


def debian_packages_settled(timeout_s: float = 900.0) -> None:
    """Wait for ops/test's background install of Debian packages to end, if one is under way,
    so that a test looking for one of them finds it (or, after a failed install, misses it)."""
    marker = os.environ.get(APT_DONE_ENV)
    if not marker:
        return
    deadline = time.monotonic() + timeout_s
    while not Path(marker).exists() and time.monotonic() < deadline:
        time.sleep(0.5)


def admin_url(url: str) -> str:
    """The same server's ``postgres`` database, where databases are created and dropped."""
    return urlparse(url)._replace(scheme="postgresql", path="/postgres").geturl()


def with_database(url: str, name: str) -> str:
    return urlparse(url)._replace(path=f"/{name}").geturl()


async def admin_execute(url: str, sql: str) -> None:
    import asyncpg

    conn = await asyncpg.connect(admin_url(url))
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


async def create_database(url: str) -> None:
    """Create the database ``url`` names unless it exists."""
    import asyncpg

    name = urlparse(url).path.lstrip("/")
    conn = await asyncpg.connect(admin_url(url))
    try:
        if not await conn.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", name):
            await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()


def create_database_sync(url: str) -> None:
    asyncio.run(create_database(url))


def drop_database_sync(url: str) -> None:
    name = urlparse(url).path.lstrip("/")
    asyncio.run(admin_execute(url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


async def empty_database(url: str) -> None:
    """Remove every row of compactd's tables (the schema stays). The table list comes from the
    models, so a new table is never left out."""
    import asyncpg

    from compactd.storage.schema import metadata

    tables = ", ".join(t.name for t in metadata.sorted_tables)
    conn = await asyncpg.connect(urlparse(url)._replace(scheme="postgresql").geturl())
    try:
        await conn.execute(f"TRUNCATE {tables} CASCADE")
    finally:
        await conn.close()


async def reset_database(url: str) -> None:
    """Create the database if absent, migrate it to head, and empty it."""
    from compactd.storage.migrate import upgrade_async

    await create_database(url)
    await upgrade_async(url)
    await empty_database(url)


def flush_redis(url: str) -> None:
    """Empty the Redis database ``url`` names (FLUSHDB: the other databases are untouched)."""
    import redis

    client = redis.Redis.from_url(url)
    try:
        client.flushdb()
    finally:
        client.close()
