"""compactd's SQL text, in one place.

Every ``*.sql`` file here holds named statements (aiosql's ``-- name:`` format): ``queries.sql``
the store's, ``recall.sql`` recall's (one file per part keeps each readable; a name is unique
across them). ``NAMED_TEXT`` holds each with ``:name`` placeholders for
SQLAlchemy's ``text()``, and :func:`positional` the same text with ``$1`` placeholders for an
asyncpg connection. A query whose docstring has a ``postgres-only:`` or
``sqlite-only:`` line runs on that backend alone, for the reason given there; where the two
spell one statement differently, ``<name>_pg`` and ``<name>_sqlite`` are its two forms, and the
connector picks its own (:meth:`storage.connectors.Connector.variant`).

``functions/<name>.sql`` is the definition of each PL/pgSQL function, in
``pg_get_functiondef``'s form: the migrations create the functions from these files, and
tests/migration compares what the database runs with them. A function's name carries its
version (``compactd_claim_v2``) and its text never changes once a release shipped it: a change
is a new version, created by a new revision beside the old one, so the workers and clients of
the previous release keep calling theirs through a rolling upgrade; a revision of a later
release drops the old version (expand, then contract: ops/RUNBOOK.md, "Upgrades"). The
unversioned ``compactd_claim`` and its kin are the first generation, which the releases up to
revision 0018 call and revisions 0009 to 0016 create; ``functions/<revision>/`` keeps the text
of that generation a database at that revision ran, where a later revision replaced it.
"""

from __future__ import annotations

import functools
import re
from importlib import resources
from typing import Any

import aiosql
from aiosql.adapters.asyncpg import AsyncPGAdapter
from aiosql.types import SQLOperationType

# The versions this code calls (queries.sql, recall.sql).
FUNCTIONS = ("compactd_append_v5", "compactd_claim_v2", "compactd_commit_v4",
             "compactd_recall_index_v2", "compactd_counts_sum_v1", "compactd_counts_reach_v1")
# The versions the previous releases call, kept by the migrations until a later release's
# contract revision drops them: a worker or client still on such a release runs on the new
# schema (the first generation up to revision 0018, the second's append and commit up to 0021,
# the third's append and commit up to 0022, the fourth's append up to 0025).
PREVIOUS_RELEASE_FUNCTIONS = ("compactd_append", "compactd_claim", "compactd_commit",
                              "compactd_recall_index", "compactd_append_v2",
                              "compactd_commit_v2", "compactd_append_v3", "compactd_commit_v3",
                              "compactd_append_v4")

_HERE = resources.files(__name__)
_QUERIES_TEXT = "\n\n".join(
    f.read_text(encoding="utf-8") for f in sorted(_HERE.iterdir(), key=lambda f: f.name)
    if f.name.endswith(".sql"))

NAMES: tuple[str, ...] = tuple(sorted(re.findall(r"^-- name: (\w+)", _QUERIES_TEXT, re.M)))
if len(set(NAMES)) != len(NAMES):
    raise RuntimeError(f"a query name is defined twice in storage/sql: {NAMES}")
# Parsed once, by aiosqlite's adapter, which keeps the :name placeholders SQLAlchemy's text()
# takes; asyncpg's $n form is made from it per query, when a connector first asks (parsing the
# text costs every process that imports the store, the CLI's hundreds in a test run included).
_NAMED: Any = aiosql.from_str(_QUERIES_TEXT, "aiosqlite")
NAMED_TEXT: dict[str, str] = {name: str(getattr(_NAMED, name).sql) for name in NAMES}

_WRITES = re.compile(r"\s*(INSERT|UPDATE|DELETE)\b", re.I)


def _only(backend: str, name: str) -> str | None:
    pattern = rf"^{backend}-only:\s*(.+?)(?=\n\S+:|\Z)"
    match = re.search(pattern, getattr(_NAMED, name).__doc__ or "", re.M | re.S)
    return None if match is None else " ".join(match.group(1).split())


def postgres_only(name: str) -> str | None:
    """Why query ``name`` runs on PostgreSQL alone, or None when it runs on SQLite too."""
    return _only("postgres", name)


def sqlite_only(name: str) -> str | None:
    """Why query ``name`` runs on SQLite alone, or None when it runs on PostgreSQL too."""
    return _only("sqlite", name)


def as_trigger_body(name: str, row: str = "NEW") -> str:
    """Query ``name`` with each ``:param`` read from the trigger's ``row`` (``NEW.param``): a
    trigger runs the same statement a caller runs with the row's columns as parameters."""
    return re.sub(r"(?<![:\w]):(\w+)", rf"{row}.\1", NAMED_TEXT[name]).strip().rstrip(";")


@functools.cache
def positional(name: str) -> tuple[str, tuple[str, ...]]:
    """Query ``name`` with asyncpg's ``$n`` placeholders, and the parameter names in their
    order, for a connector that runs it on an asyncpg connection itself (aiosql's own call
    costs about as much CPU as the statement's round trip)."""
    if sqlite_only(name) is not None:
        raise KeyError(f"query {name!r} runs on SQLite only")
    query = getattr(_NAMED, name)
    adapter = AsyncPGAdapter()
    text = adapter.process_sql(name, query.operation, NAMED_TEXT[name])
    return text, tuple(adapter.var_sorted[name])


def returns_rows(name: str) -> bool:
    """Whether query ``name`` returns rows (a select, or a write with RETURNING)."""
    return getattr(_NAMED, name).operation not in (
        SQLOperationType.INSERT_UPDATE_DELETE, SQLOperationType.INSERT_UPDATE_DELETE_MANY,
        SQLOperationType.SCRIPT)


def writes(name: str) -> bool:
    """Whether query ``name`` changes rows (its own transaction on SQLite)."""
    return _WRITES.match(NAMED_TEXT[name]) is not None


def postgres_text(name: str) -> str:
    """Query ``name`` with ``:name`` placeholders, for a statement in a SQLAlchemy transaction
    on PostgreSQL."""
    if sqlite_only(name) is not None:
        raise KeyError(f"query {name!r} runs on SQLite only")
    return NAMED_TEXT[name]


def sqlite_text(name: str) -> str:
    """Query ``name`` with ``:name`` placeholders, as SQLAlchemy's ``text()`` takes it."""
    if postgres_only(name) is not None:
        raise KeyError(f"query {name!r} runs on PostgreSQL only")
    return NAMED_TEXT[name]


def function_definition(name: str, revision: str | None = None) -> str:
    """The ``CREATE OR REPLACE FUNCTION`` statement of ``name`` (its comment lines dropped); with
    ``revision``, the text a database at that revision ran (``functions/<revision>/``), which a
    later revision's downgrade restores: the first generation changed under its own name before
    functions were versioned."""
    folder = _HERE.joinpath("functions") if revision is None else _HERE.joinpath(
        "functions", revision)
    return _uncommented(folder.joinpath(f"{name}.sql"))


def _uncommented(path: Any) -> str:
    text = path.read_text(encoding="utf-8")
    return "\n".join(line for line in text.splitlines() if not line.startswith("--")).strip()


def function_signature(name: str) -> str:
    """``name(type, ...)``: the function of file ``name`` as ``DROP FUNCTION`` names it (the
    types of its parameters, in order)."""
    match = re.search(r"CREATE OR REPLACE FUNCTION (\w+)\((.*?)\)\n", function_definition(name))
    if match is None:
        raise ValueError(f"storage/sql/functions/{name}.sql has no CREATE FUNCTION line")
    types = [parameter.split(None, 1)[1] for parameter in match.group(2).split(", ")]
    return f"{match.group(1)}({', '.join(types)})"
