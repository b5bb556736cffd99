"""The recall tests' compacted sample (tests/support/recall_sample.py), put back into an empty
database, is every row its runs left there, in every table the database holds: the tests that
read it see what a real run wrote."""

from __future__ import annotations

import shutil
from pathlib import Path

import sqlalchemy as sa

from compactd.storage.database import snapshot
from compactd.storage.store import Store
from tests.support.recall_sample import compact_sample, rows_kind
from tests.support.services import empty_database


async def every_row(database_url: str) -> dict[str, list[str]]:
    """Each table of the live database (the schema's, and what migrations make beside them)
    with its rows, in an order of their own."""
    store = Store.from_url(database_url)
    try:
        async with snapshot(store.engine) as conn:
            names = await conn.run_sync(lambda sync: sa.inspect(sync).get_table_names())
            return {name: sorted(repr(tuple(row)) for row in (await conn.execute(
                sa.text(f'SELECT * FROM "{name}"'))).all()) for name in names}
    finally:
        await store.close()


async def test_the_sample_put_back_is_every_row_its_runs_left(
        db_url: str, sqlite_template: Path, tmp_path: Path) -> None:
    await compact_sample(db_url)
    left = await every_row(db_url)
    assert len(left["sessions"]) == 2 and left["recall_originals"], left.keys()
    rows = await rows_kind(db_url).take(db_url)
    if db_url.startswith("postgresql"):
        await empty_database(db_url)
        target = db_url
    else:
        path = tmp_path / "put-back.sqlite3"
        shutil.copy(sqlite_template, path)
        target = f"sqlite:///{path}"
    assert (await every_row(target))["sessions"] == []
    await rows.restore(target)
    put_back = await every_row(target)
    assert put_back.keys() == left.keys()
    assert [name for name in left if put_back[name] != left[name]] == []
