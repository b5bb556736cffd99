"""The PL/pgSQL forms of storage.counters (``compactd_counts_sum_v1``,
``compactd_counts_reach_v1``, which the append and the commit keep the counts by name with)
give what the Python forms the SQLite connector runs give, on the same inputs."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
import sqlalchemy as sa

from compactd.storage.counters import reaches, summed
from compactd.storage.database import connection
from compactd.storage.store import Store

COUNTS: list[list[dict[str, int] | None]] = [
    [], [None], [None, None], [{"a": 1}], [{"a": 1}, None, {"a": 2, "b": 1}],
    [{"a": 2}, {"a": -2, "b": 1}], [{"b": 5, "a": 1}, {"a": 10**12}], [{"a": -1}],
]
FLOORS: list[tuple[dict[str, int] | None, dict[str, int] | None]] = [
    (None, None), ({"a": 3}, None), ({"a": 3}, {"a": 3}), ({"a": 2}, {"a": 3}),
    (None, {"a": 0}), (None, {"a": 1}), ({"a": 1}, {"a": 5, "b": 1}),
    ({"a": 1, "b": 1}, {"a": 5, "b": 1}),
]


@pytest.fixture
async def pg_store(clean_pg: str) -> AsyncIterator[Store]:
    store = Store.from_url(clean_pg)
    try:
        yield store
    finally:
        await store.close()


def _json(value: Any) -> str | None:
    return None if value is None else json.dumps(value)


async def test_the_sum_by_name_is_the_same_in_sql_and_python(pg_store: Store) -> None:
    async with connection(pg_store.engine) as conn:
        for counts in COUNTS:
            got = (await conn.execute(
                sa.text("SELECT compactd_counts_sum_v1(CAST(:counts AS json[]))::text"),
                {"counts": [_json(c) for c in counts]})).scalar()
            assert (None if got is None else json.loads(got)) == summed(counts), counts


async def test_reaching_the_floors_is_the_same_in_sql_and_python(pg_store: Store) -> None:
    async with connection(pg_store.engine) as conn:
        for counts, floors in FLOORS:
            got = (await conn.execute(
                sa.text("SELECT compactd_counts_reach_v1(CAST(:counts AS json),"
                        " CAST(:floors AS json))"),
                {"counts": _json(counts), "floors": _json(floors)})).scalar()
            assert got is reaches(counts, floors), (counts, floors)
