"""A session whose compaction replaced a fact the local summary drops (the needle), on the test's
database: what the recall tests of the store, the clients, the HTTP routes and the CLI search for.

    store, sample = compacted          # the fixture: sessions s1 (acme) and s2 (globex)
    await store.history_search("s1", NEEDLE, tenant="acme")

The runs are made once per test process and kind of database; every later test of the fixture
gets the rows they left put back into its own empty database (tests/integration/
test_recall_sample.py holds them to what the runs left).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import asyncpg
import pytest

from compactd.scheduler.samples import coding_session
from compactd.storage.messages import parse_openai
from compactd.storage.schema import metadata
from compactd.storage.store import Store
from compactd.worker.orchestration import compact
from compactd.worker.runtime import open_deps
from compactd.worker.settings import Settings, build_config

POLICY = {"trigger": [{"type": "tokens", "value": 20_000}],
          "keep": {"type": "messages", "value": 12}}
NEEDLE = "ERR-7f3a9c: checksum mismatch in /srv/data/part-00017.parquet"


def needle_messages(needle_at: int = 10) -> list[dict[str, Any]]:
    sample = coding_session(steps=40).messages
    # A fact the local summary drops: inside a long, ordinary tool result.
    for i, m in enumerate(sample):
        if i >= needle_at and m["role"] == "tool":
            m["content"] = m["content"] + "\n" + NEEDLE + "\n"
            break
    return sample


SESSIONS = (("s1", "acme"), ("s2", "globex"))


async def compact_sample(database_url: str,
                         sessions: tuple[tuple[str, str], ...] = SESSIONS) -> None:
    """Sessions of :func:`needle_messages` (by id and tenant), each compacted by a real run on
    ``database_url``."""
    config = build_config({}, settings=Settings(database_url=database_url,
                                                broker_url="memory://"))
    sample = needle_messages()
    async with open_deps(config, owner="recall-test") as deps:
        for session_id, tenant in sessions:
            await deps.store.create_session(session_id, tenant=tenant, context_window=128_000,
                                            policy=POLICY)
            await deps.store.append(session_id, [parse_openai(m) for m in sample])
            outcome = await compact(deps, session_id, trigger="pressure")
            assert outcome.outcome == "committed", outcome.to_json()
            assert (await deps.store.verify(session_id)).ok


class SqliteRows:
    """What a run left in an embedded database: its files, put back whole."""

    SUFFIXES = ("", "-wal", "-shm")

    def __init__(self, files: dict[str, bytes]) -> None:
        self.files = files

    @staticmethod
    def path(database_url: str) -> str:
        return database_url.removeprefix("sqlite:///")

    @classmethod
    async def take(cls, database_url: str) -> SqliteRows:
        path = cls.path(database_url)
        return cls({suffix: Path(path + suffix).read_bytes() for suffix in cls.SUFFIXES
                    if Path(path + suffix).exists()})

    async def restore(self, database_url: str) -> None:
        path = self.path(database_url)
        for suffix in self.SUFFIXES:
            Path(path + suffix).unlink(missing_ok=True)
        for suffix, data in self.files.items():
            Path(path + suffix).write_bytes(data)


class PostgresRows:
    """What a run left in compactd's PostgreSQL tables: every stored column of every row, put
    back into emptied tables, referenced tables first."""

    def __init__(self, tables: dict[str, tuple[list[str], list[tuple[Any, ...]]]]) -> None:
        self.tables = tables

    @staticmethod
    async def connect(database_url: str) -> asyncpg.Connection:
        return await asyncpg.connect(urlparse(database_url)._replace(scheme="postgresql")
                                     .geturl())

    @classmethod
    async def take(cls, database_url: str) -> PostgresRows:
        conn = await cls.connect(database_url)
        try:
            tables = {}
            for table in metadata.sorted_tables:
                # A generated column is computed again as its row goes back in.
                columns = [row["column_name"] for row in await conn.fetch(
                    "SELECT column_name FROM information_schema.columns "
                    "WHERE table_schema = current_schema() AND table_name = $1 "
                    "AND is_generated = 'NEVER' ORDER BY ordinal_position", table.name)]
                names = ", ".join(f'"{column}"' for column in columns)
                rows = await conn.fetch(f'SELECT {names} FROM "{table.name}"')
                if rows:
                    tables[table.name] = (columns, [tuple(row) for row in rows])
        finally:
            await conn.close()
        return cls(tables)

    async def restore(self, database_url: str) -> None:
        conn = await self.connect(database_url)
        try:
            async with conn.transaction():
                for table, (columns, rows) in self.tables.items():
                    await conn.copy_records_to_table(table, records=rows, columns=columns)
        finally:
            await conn.close()


# What compact_sample left, by the kind of database and the sessions, once per test process:
# each later test gets it put back into its own empty database instead of runs of its own.
_COMPACTED: dict[tuple[str, tuple[tuple[str, str], ...]], SqliteRows | PostgresRows] = {}


def rows_kind(database_url: str) -> type[SqliteRows] | type[PostgresRows]:
    return PostgresRows if database_url.startswith("postgresql") else SqliteRows


async def compacted_sample(database_url: str,
                           sessions: tuple[tuple[str, str], ...] = SESSIONS) -> None:
    """What :func:`compact_sample` leaves, in ``database_url`` (empty, migrated): the runs' own
    rows the first time in this process, put back after."""
    kind = rows_kind(database_url)
    rows = _COMPACTED.get((kind.__name__, sessions))
    if rows is None:
        await compact_sample(database_url, sessions)
        _COMPACTED[kind.__name__, sessions] = await kind.take(database_url)
    else:
        await rows.restore(database_url)


@pytest.fixture
async def compacted(db_url: str) -> AsyncIterator[tuple[Store, list[dict[str, Any]]]]:
    await compacted_sample(db_url)
    store = Store.from_url(db_url)
    try:
        yield store, needle_messages()
    finally:
        await store.close()
