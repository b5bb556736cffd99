"""Alembic environment: async, driven by storage.migrate or the alembic CLI."""

from __future__ import annotations

import asyncio
import os

from alembic import context
from sqlalchemy.engine import Connection

from compactd.storage.database import create_engine, embedded_url
from compactd.storage.schema import metadata, unmanaged

config = context.config
target_metadata = metadata


def _url() -> str:
    return (config.attributes.get("url") or config.get_main_option("sqlalchemy.url")
            or os.environ.get("COMPACTD_DATABASE_URL") or embedded_url())


def _include_name(name: str | None, type_: str, _parents: object) -> bool:
    return not (type_ in ("table", "index", "column") and unmanaged(name))


def _refuse_irreversible(connection: Connection) -> None:
    """Refuse, before any step runs, a downgrade that passes a revision whose module states
    why it cannot be undone (``DOWNGRADE_REFUSED``) and does not go to base: SQLite's DDL is not
    transactional under Alembic, so a refusal raised by the step itself would leave the steps
    above it done."""
    from alembic.runtime.migration import MigrationContext
    from alembic.script import ScriptDirectory
    from alembic.script.revision import RevisionError
    from alembic.util import CommandError

    try:
        destination = context.get_revision_argument()
    except KeyError:  # no migration runs (alembic check)
        return
    if destination is None:  # base: nothing is left that a release runs
        return
    current = MigrationContext.configure(connection).get_current_revision()
    if current is None or current == destination:
        return
    script = ScriptDirectory.from_config(config)
    try:
        passed = list(script.iterate_revisions(current, destination))
    except RevisionError:  # not below the current revision: an upgrade
        return
    for rev in passed:
        refused = getattr(rev.module, "DOWNGRADE_REFUSED", None)
        if refused and rev.revision != destination:
            raise CommandError(f"downgrade to {destination} refused: {refused} Nothing was"
                               " changed.")


def _configure(connection: Connection) -> None:
    # A transaction per revision: the locks a revision takes go with its commit instead of
    # being held to the end of the chain, and a revision may leave its transaction for an
    # autocommit block (storage.online_migrations: concurrent index builds, batched backfills).
    context.configure(connection=connection, target_metadata=target_metadata,
                      compare_type=True, render_as_batch=connection.dialect.name == "sqlite",
                      include_name=_include_name, transaction_per_migration=True)
    _refuse_irreversible(connection)
    if connection.in_transaction():  # the check's read: each revision begins its own
        connection.commit()
    with context.begin_transaction():
        context.run_migrations()


async def _run_online() -> None:
    # Nothing prepared by name: a migration runs each statement once, and may run through a
    # pooler in transaction mode (database.statement_cache), which this process does not read.
    engine = create_engine(_url(), pool_size=1, statement_cache=False)
    try:
        async with engine.connect() as connection:
            await connection.run_sync(_configure)
            await connection.commit()
    finally:
        await engine.dispose()


def run_migrations_offline() -> None:
    context.configure(url=_url(), target_metadata=target_metadata, literal_binds=True,
                      compare_type=True, include_name=_include_name)
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    run_migrations_offline()
else:
    connection = config.attributes.get("connection")
    if connection is not None:
        _configure(connection)
    else:
        asyncio.run(_run_online())
