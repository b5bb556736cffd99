"""How a deletion spaces its batches (storage.connectors.DeletionPace, storage.deletion):
fitted to a time per batch on SQLite, fixed on PostgreSQL, and the pause after each."""

from __future__ import annotations

import sqlalchemy as sa

from compactd.storage import schema as t
from compactd.storage.connectors import DeletionPace, PostgresConnector, SQLiteConnector
from compactd.storage.deletion import _BatchSizes

EVENTS: sa.Table = t.events
SURFACE: sa.Table = t.surface


def test_without_a_time_per_batch_every_batch_has_the_deletions_row_count() -> None:
    sizes = _BatchSizes(DeletionPace(), 1000)
    sizes.took(EVENTS, 1000, 5.0)
    assert sizes.rows(EVENTS) == 1000
    assert DeletionPace().rest_after(5.0) == 0.0


def test_batches_are_fitted_to_the_time_per_batch_table_by_table() -> None:
    sizes = _BatchSizes(DeletionPace(batch_s=0.01), 1000)
    sizes.took(EVENTS, 1000, 0.04)  # four times the budget: a quarter of the rows next
    assert sizes.rows(EVENTS) == 250
    assert sizes.rows(SURFACE) == 1000  # another table keeps its own
    sizes.took(EVENTS, 250, 0.001)  # much faster: at most twice the rows at once
    assert sizes.rows(EVENTS) == 500
    sizes.took(EVENTS, 500, 1.0)  # never below the floor
    assert sizes.rows(EVENTS) == _BatchSizes.MIN_ROWS
    sizes.took(SURFACE, 10, 1.0)  # a partial batch (the table's last) fits nothing
    assert sizes.rows(SURFACE) == 1000


def test_a_small_deletion_batch_is_not_raised_to_the_floor() -> None:
    sizes = _BatchSizes(DeletionPace(batch_s=0.01), 3)
    sizes.took(EVENTS, 3, 1.0)
    assert sizes.rows(EVENTS) == 3


def test_sqlite_pauses_after_each_batch_at_least_as_long_as_it_took_postgres_does_not() -> None:
    sqlite = SQLiteConnector.deletion_pace
    assert sqlite.batch_s is not None
    for took in (0.0, 0.002, 0.01, 0.3):
        assert sqlite.rest_after(took) >= took and sqlite.rest_after(took) > 0
    postgres = PostgresConnector.deletion_pace
    assert postgres.batch_s is None and postgres.rest_after(0.01) == 0.0
