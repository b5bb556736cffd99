"""The functions PostgreSQL runs are the ones storage/sql defines: after the migrations,
``pg_get_functiondef`` of each equals its file, and compactd has no other function than the
versions this code calls and those the previous release calls."""

from __future__ import annotations

import asyncio
import re
import uuid

import asyncpg
import pytest

from compactd.storage.migrate import upgrade
from compactd.storage.sql import FUNCTIONS, PREVIOUS_RELEASE_FUNCTIONS, function_definition
from tests.support.services import create_database_sync, drop_database_sync, with_database


@pytest.fixture
def migrated_pg(pg_url: str):  # type: ignore[no-untyped-def]
    url = with_database(pg_url, f"compactd_fun_{uuid.uuid4().hex[:8]}")
    create_database_sync(url)
    upgrade(url)
    yield url.replace("postgresql+asyncpg://", "postgresql://")
    drop_database_sync(url)


def normalized(definition: str, schema: str = "public") -> str:
    """The definition with runs of whitespace as one space, no trailing semicolon, and the
    function's name unqualified (pg_get_functiondef names its schema)."""
    text = definition.strip().rstrip(";")
    text = re.sub(rf"^(CREATE OR REPLACE FUNCTION ){re.escape(schema)}\.", r"\1", text)
    return " ".join(text.split())


async def _definitions(url: str) -> dict[str, str]:
    conn = await asyncpg.connect(url)
    try:
        rows = await conn.fetch(
            "SELECT p.proname, n.nspname, pg_get_functiondef(p.oid) AS definition"
            " FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace"
            " WHERE p.proname LIKE 'compactd%' ORDER BY p.proname")
    finally:
        await conn.close()
    names = [r["proname"] for r in rows]
    assert len(names) == len(set(names)), f"overloaded compactd functions: {names}"
    return {r["proname"]: normalized(r["definition"], r["nspname"]) for r in rows}


def test_the_database_runs_the_functions_of_storage_sql(migrated_pg: str) -> None:
    running = asyncio.run(_definitions(migrated_pg))
    assert sorted(running) == sorted(FUNCTIONS + PREVIOUS_RELEASE_FUNCTIONS)
    for name in FUNCTIONS + PREVIOUS_RELEASE_FUNCTIONS:
        assert running[name] == normalized(function_definition(name)), (
            f"{name}: the migrations create another definition than "
            f"storage/sql/functions/{name}.sql")


def test_a_function_changed_in_the_database_differs(migrated_pg: str) -> None:
    """The comparison is real: a body changed by one token no longer matches its file."""
    changed = function_definition("compactd_claim").replace(
        "new_fence := s.lease_fence + 1;", "new_fence := s.lease_fence + 2;")
    assert changed != function_definition("compactd_claim")

    async def replace() -> None:
        conn = await asyncpg.connect(migrated_pg)
        try:
            await conn.execute(changed)
        finally:
            await conn.close()

    asyncio.run(replace())
    running = asyncio.run(_definitions(migrated_pg))
    assert running["compactd_claim"] != normalized(function_definition("compactd_claim"))
    assert running["compactd_claim"] == normalized(changed)
