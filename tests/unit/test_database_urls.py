"""Database URLs as people write them, in the form the asyncpg dialect reads: libpq's multi-host
URL (a primary and its standbys, with target_session_attrs) reaches asyncpg as a host list."""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from sqlalchemy.dialects.postgresql.asyncpg import dialect as asyncpg_dialect

from compactd.storage.database import normalize_url
from compactd.storage.errors import CompactdError

MULTI = ("postgresql://compactd:pw@db-a:5432,db-b:5433/compactd"
         "?target_session_attrs=read-write")


def connect_args(url: str) -> dict[str, object]:
    _, kwargs = asyncpg_dialect().create_connect_args(sa.engine.make_url(normalize_url(url)))
    return dict(kwargs)


def test_libpq_multi_host_url_reaches_asyncpg_as_a_host_list_with_its_session_attrs() -> None:
    args = connect_args(MULTI)
    assert args["host"] == ["db-a", "db-b"] and args["port"] == [5432, 5433]
    assert args["target_session_attrs"] == "read-write"
    assert args["user"] == "compactd" and args["password"] == "pw"
    assert args["database"] == "compactd"


def test_multi_host_without_a_query_and_with_the_asyncpg_scheme() -> None:
    args = connect_args("postgresql+asyncpg://u@a:1,b:2/db")
    assert args["host"] == ["a", "b"] and args["port"] == [1, 2]
    assert "target_session_attrs" not in args


def test_a_single_host_url_is_unchanged() -> None:
    url = "postgresql://u@h:5432/db?target_session_attrs=read-write"
    assert normalize_url(url) == "postgresql+asyncpg://u@h:5432/db?target_session_attrs=read-write"
    assert connect_args(url)["target_session_attrs"] == "read-write"


def test_an_empty_host_in_the_list_is_refused_by_name() -> None:
    with pytest.raises(CompactdError, match="empty host"):
        normalize_url("postgresql://u@a:1,,b:2/db")
