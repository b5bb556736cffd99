"""compactd's SQL text, in one place.

``queries.sql`` holds every named statement (aiosql's ``-- name:`` format), loaded once per
parameter style: ``POSTGRES`` runs on an asyncpg connection (``$1`` placeholders), and
``NAMED_TEXT`` holds the same text with ``:name`` placeholders for SQLAlchemy's ``text()``. A
query whose docstring has a ``postgres-only:`` line runs on PostgreSQL alone, for the reason
given there.

``functions/<name>.sql`` is the current definition of each PL/pgSQL function, in
``pg_get_functiondef``'s form: the migrations create the functions from these files, and
tests/migration compares what the database runs with them.
"""

from __future__ import annotations

import functools
import re
from importlib import resources
from typing import Any

import aiosql
from aiosql.types import SQLOperationType

FUNCTIONS = ("compactd_append", "compactd_claim", "compactd_commit")

_HERE = resources.files(__name__)
_QUERIES_TEXT = _HERE.joinpath("queries.sql").read_text(encoding="utf-8")

POSTGRES: Any = aiosql.from_str(_QUERIES_TEXT, "asyncpg")
NAMES: tuple[str, ...] = tuple(sorted(re.findall(r"^-- name: (\w+)", _QUERIES_TEXT, re.M)))
# aiosqlite's adapter keeps the :name placeholders SQLAlchemy's text() takes.
_NAMED: Any = aiosql.from_str(_QUERIES_TEXT, "aiosqlite")
NAMED_TEXT: dict[str, str] = {name: str(getattr(_NAMED, name).sql) for name in NAMES}

_WRITES = re.compile(r"\s*(INSERT|UPDATE|DELETE)\b", re.I)
_POSTGRES_ONLY = re.compile(r"^postgres-only:\s*(.+?)(?=\n\S+:|\Z)", re.M | re.S)


def postgres_only(name: str) -> str | None:
    """Why query ``name`` runs on PostgreSQL alone, or None when it runs on both backends."""
    match = _POSTGRES_ONLY.search(getattr(POSTGRES, name).__doc__ or "")
    return None if match is None else " ".join(match.group(1).split())


@functools.cache
def positional(name: str) -> tuple[str, tuple[str, ...]]:
    """Query ``name`` with asyncpg's ``$n`` placeholders, and the parameter names in their
    order, for a connector that runs it on an asyncpg connection itself (aiosql's own call
    costs about as much CPU as the statement's round trip)."""
    query = getattr(POSTGRES, name)
    return str(query.sql), tuple(POSTGRES.driver_adapter.var_sorted[name])


def returns_rows(name: str) -> bool:
    """Whether query ``name`` returns rows (a select, or a write with RETURNING)."""
    return getattr(POSTGRES, name).operation not in (
        SQLOperationType.INSERT_UPDATE_DELETE, SQLOperationType.INSERT_UPDATE_DELETE_MANY,
        SQLOperationType.SCRIPT)


def writes(name: str) -> bool:
    """Whether query ``name`` changes rows (its own transaction on SQLite)."""
    return _WRITES.match(NAMED_TEXT[name]) is not None


def sqlite_text(name: str) -> str:
    """Query ``name`` with ``:name`` placeholders, as SQLAlchemy's ``text()`` takes it."""
    if postgres_only(name) is not None:
        raise KeyError(f"query {name!r} runs on PostgreSQL only")
    return NAMED_TEXT[name]


def function_definition(name: str) -> str:
    """The ``CREATE OR REPLACE FUNCTION`` statement of ``name`` (its comment lines dropped)."""
    text = _HERE.joinpath("functions", f"{name}.sql").read_text(encoding="utf-8")
    return "\n".join(line for line in text.splitlines() if not line.startswith("--")).strip()
