"""The PL/pgSQL forms of storage.counters (``compactd_counts_sum_v1``,
``compactd_counts_reach_v1``, which the append and the commit keep the counts by name with)
give what the Python forms the SQLite connector runs give, on the same inputs."""

from __future__ import annotations

import json
from typing import Any

import asyncpg

from compactd.storage.counters import reaches, summed

COUNTS: list[list[dict[str, int] | None]] = [
    [], [None], [None, None], [{"a": 1}], [{"a": 1}, None, {"a": 2, "b": 1}],
    [{"a": 2}, {"a": -2, "b": 1}], [{"b": 5, "a": 1}, {"a": 10**12}], [{"a": -1}],
]
FLOORS: list[tuple[dict[str, int] | None, dict[str, int] | None]] = [
    (None, None), ({"a": 3}, None), ({"a": 3}, {"a": 3}), ({"a": 2}, {"a": 3}),
    (None, {"a": 0}), (None, {"a": 1}), ({"a": 1}, {"a": 5, "b": 1}),
    ({"a": 1, "b": 1}, {"a": 5, "b": 1}),
]


def _json(value: Any) -> str | None:
    return None if value is None else json.dumps(value)


async def test_the_sum_by_name_is_the_same_in_sql_and_python(clean_pg: str) -> None:
    conn = await asyncpg.connect(clean_pg)
    try:
        for counts in COUNTS:
            got = await conn.fetchval("SELECT compactd_counts_sum_v1($1::text[]::json[])::text",
                                      [_json(c) for c in counts])
            assert (None if got is None else json.loads(got)) == summed(counts), counts
    finally:
        await conn.close()


async def test_reaching_the_floors_is_the_same_in_sql_and_python(clean_pg: str) -> None:
    conn = await asyncpg.connect(clean_pg)
    try:
        for counts, floors in FLOORS:
            got = await conn.fetchval("SELECT compactd_counts_reach_v1($1::text::json,"
                                      " $2::text::json)", _json(counts), _json(floors))
            assert got is reaches(counts, floors), (counts, floors)
    finally:
        await conn.close()
