"""storage.schema's column types as each backend stores them: an aware time of any offset is
stored on SQLite as its UTC fields without a zone (the text SQLite compares), and read back
aware in UTC; a naive time is refused before it reaches the database."""

from __future__ import annotations

import datetime as dt

import pytest
import sqlalchemy as sa

from compactd.storage.schema import UTCDateTime

TIMES = sa.Table("times", sa.MetaData(), sa.Column("at", UTCDateTime()))
PLUS_TWO = dt.timezone(dt.timedelta(hours=2))


@pytest.fixture
def sqlite() -> sa.Engine:
    engine = sa.create_engine("sqlite://")
    TIMES.create(engine)
    return engine


def test_an_aware_time_is_stored_on_sqlite_as_naive_utc_and_read_back_aware(
        sqlite: sa.Engine) -> None:
    at = dt.datetime(2026, 1, 1, 12, 30, 5, 7, tzinfo=PLUS_TWO)
    with sqlite.begin() as conn:
        conn.execute(TIMES.insert(), {"at": at})
        stored = conn.exec_driver_sql("SELECT at FROM times").scalar_one()
        read = conn.execute(sa.select(TIMES.c.at)).scalar_one()
        later = conn.execute(sa.select(sa.func.count()).where(
            TIMES.c.at < dt.datetime(2026, 1, 1, 10, 30, 6, tzinfo=dt.UTC))).scalar_one()
    assert stored == "2026-01-01 10:30:05.000007"
    assert read == at and read.tzinfo == dt.UTC
    assert later == 1


def test_a_naive_time_is_refused(sqlite: sa.Engine) -> None:
    with pytest.raises(sa.exc.StatementError, match="naive datetime"), sqlite.begin() as conn:
        conn.execute(TIMES.insert(), {"at": dt.datetime(2026, 1, 1, 12, 0)})
