"""Database URLs as people write them, in the form the asyncpg dialect reads: libpq's multi-host
URL (a primary and its standbys, with target_session_attrs) reaches asyncpg as a host list."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.dialects.postgresql.asyncpg import dialect as asyncpg_dialect

from compactd.storage.database import create_engine, database_exists, normalize_url
from compactd.storage.errors import CompactdError, ConfigError

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


@pytest.mark.parametrize(("url", "normalized"), [
    ("postgres://u@h/db", "postgresql+asyncpg://u@h/db"),
    ("postgresql://u@h/db", "postgresql+asyncpg://u@h/db"),
    ("postgresql+psycopg2://u@h/db", "postgresql+asyncpg://u@h/db"),
    ("postgresql+psycopg://u@h/db", "postgresql+asyncpg://u@h/db"),
    ("postgresql+asyncpg://u@h/db", "postgresql+asyncpg://u@h/db"),
    ("sqlite:///var/compactd.sqlite3", "sqlite+aiosqlite:///var/compactd.sqlite3"),
    ("sqlite+aiosqlite:///var/compactd.sqlite3", "sqlite+aiosqlite:///var/compactd.sqlite3"),
])
def test_each_backends_schemes_pick_its_async_driver(url: str, normalized: str) -> None:
    assert normalize_url(url) == normalized


@pytest.mark.parametrize("url", ["mysql://u@h/db", "sqlite3:///x", "postgresqlx://u@h/db"])
def test_a_scheme_no_backend_takes_is_refused_by_name(url: str) -> None:
    scheme = url.split("://")[0]
    with pytest.raises(CompactdError, match=f"unsupported database URL {scheme}://"):
        normalize_url(url)
    with pytest.raises(CompactdError, match=f"unsupported database URL {scheme}://"):
        create_engine(url)


def test_a_sqlite_file_exists_only_once_created_and_a_server_database_always(
        tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'compactd.sqlite3'}"
    assert not database_exists(url)
    (tmp_path / "compactd.sqlite3").touch()
    assert database_exists(url)
    assert database_exists("sqlite+aiosqlite:///:memory:")
    assert database_exists("postgresql://u@nowhere.invalid/db")


@pytest.mark.parametrize(("url", "problem"), [
    ("postgresql://u:pw@db-a:5432,db-b:notaport/db", "the port of host 'db-b' must be a number"),
    ("postgresql://u:pw@db-a:notaport/db", "the port of host 'db-a' must be a number"),
    ("postgresql://u:pw@db-a:0,db-b/db", "the port of host 'db-a' must be a number"),
    ("postgresql://u:pw@db-a,db-b/db?target_session_attrs=primary-please",
     "target_session_attrs must be one of any, primary, standby, prefer-standby, read-write, "
     "read-only, not 'primary-please'"),
    ("postgresql://u@db-a,db-b/db?connect_timeout=0",
     "connect_timeout must be a positive number of seconds, not '0'"),
    ("postgresql://u@db-a/db?connect_timeout=-2",
     "connect_timeout must be a positive number of seconds, not '-2'"),
    ("postgresql://u@db-a/db?connect_timeout=soon",
     "connect_timeout must be a positive number of seconds, not 'soon'"),
])
def test_a_host_list_the_driver_cannot_use_is_refused_as_bad_input_naming_it(
        url: str, problem: str) -> None:
    """Refused where the URL is read, as bad input: a port that is not one was a traceback out
    of SQLAlchemy's URL parser, an unknown target_session_attrs a connection error at every
    connection (retryable, as if the server were down)."""
    with pytest.raises(ConfigError, match=re.escape(problem)):
        normalize_url(url)
    assert normalize_url("postgresql://u@db-a:,[::1]:5433/db")  # empty port: the default


@pytest.mark.parametrize("url", ["postgresql://u:pa/ss+w0rd@db-a:5432/db",
                                 "postgresql://u:pa/ss+w0rd@db-a:5432,db-b:5433/db"])
def test_a_password_with_a_slash_is_read_as_sqlalchemy_reads_it(url: str) -> None:
    args = connect_args(url)
    assert args["user"] == "u" and args["password"] == "pa/ss+w0rd"
    assert args["database"] == "db" and "db-a" in str(args["host"])
