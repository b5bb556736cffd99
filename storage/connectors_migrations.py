"""Each backend's way of changing its schema while compactd runs, for
:mod:`storage.online_migrations`: PostgreSQL builds and drops indexes ``CONCURRENTLY`` and
commits each backfill batch on its own, outside the revision's transaction (Alembic's
autocommit block), so writes go on meanwhile; SQLite (the embedded default, one process) has no
concurrent writers to keep, and runs the same changes as plain statements in the revision's
transaction."""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Iterator, Sequence

import sqlalchemy as sa
from alembic import op

from compactd.storage import sql


class OnlineChanges(abc.ABC):
    """One backend's schema changes that hold no table lock for longer than a catalog write."""

    @abc.abstractmethod
    def batches(self) -> contextlib.AbstractContextManager[None]:
        """The block a backfill's batches run in, each committed as soon as it is written where
        others write meanwhile."""

    @abc.abstractmethod
    def create_index(self, name: str, table: str, columns: Sequence[str | sa.TextClause], *,
                     where: str | None, unique: bool) -> None:
        """Build the index if it is not there, without blocking writes to ``table``."""

    @abc.abstractmethod
    def drop_index(self, name: str, table: str) -> None:
        """Drop the index if it is there, without blocking writes to ``table``."""

    @abc.abstractmethod
    def create_functions(self, names: Sequence[str]) -> None:
        """Create these versions of compactd's SQL functions (``storage/sql/functions/``)."""

    @abc.abstractmethod
    def drop_functions(self, names: Sequence[str]) -> None:
        """Drop these versions of compactd's SQL functions if they are there."""


class PostgresOnlineChanges(OnlineChanges):
    @contextlib.contextmanager
    def batches(self) -> Iterator[None]:
        # Autocommit: each batch's UPDATE is a transaction of its own.
        with op.get_context().autocommit_block():
            yield

    def create_index(self, name: str, table: str, columns: Sequence[str | sa.TextClause], *,
                     where: str | None, unique: bool) -> None:
        with op.get_context().autocommit_block():
            # An interrupted CONCURRENTLY build leaves an invalid index: dropped and built again.
            invalid = op.get_bind().execute(sa.text(sql.NAMED_TEXT["invalid_index"]),
                                            {"index_name": name}).first()
            if invalid is not None:
                op.drop_index(name, table_name=table, postgresql_concurrently=True)
            op.create_index(name, table, list(columns), unique=unique, if_not_exists=True,
                            postgresql_concurrently=True,
                            postgresql_where=sa.text(where) if where else None)

    def drop_index(self, name: str, table: str) -> None:
        with op.get_context().autocommit_block():
            op.drop_index(name, table_name=table, postgresql_concurrently=True, if_exists=True)

    def create_functions(self, names: Sequence[str]) -> None:
        for name in names:
            op.execute(sql.function_definition(name))

    def drop_functions(self, names: Sequence[str]) -> None:
        for name in reversed(names):
            op.execute(f"DROP FUNCTION IF EXISTS {sql.function_signature(name)}")


class SQLiteOnlineChanges(OnlineChanges):
    @contextlib.contextmanager
    def batches(self) -> Iterator[None]:
        # One writer at a time anyway: the batches run in the revision's transaction.
        yield

    def create_index(self, name: str, table: str, columns: Sequence[str | sa.TextClause], *,
                     where: str | None, unique: bool) -> None:
        op.create_index(name, table, list(columns), unique=unique, if_not_exists=True,
                        sqlite_where=sa.text(where) if where else None)

    def drop_index(self, name: str, table: str) -> None:
        op.drop_index(name, table_name=table, if_exists=True)

    def create_functions(self, names: Sequence[str]) -> None:
        # No stored functions: the SQLite connector runs their logic in Python.
        pass

    def drop_functions(self, names: Sequence[str]) -> None:
        pass


_BY_DIALECT: dict[str, OnlineChanges] = {
    "postgresql": PostgresOnlineChanges(), "sqlite": SQLiteOnlineChanges()}


def online_changes() -> OnlineChanges:
    """The online changes of the backend the running revision migrates."""
    return _BY_DIALECT[op.get_bind().dialect.name]
