"""Alembic environment: async, driven by storage.migrate or the alembic CLI."""

from __future__ import annotations

import asyncio
import os

from alembic import context
from sqlalchemy.engine import Connection

from storage.database import create_engine, embedded_url
from storage.schema import metadata, unmanaged

config = context.config
target_metadata = metadata


def _url() -> str:
    return (config.attributes.get("url") or config.get_main_option("sqlalchemy.url")
            or os.environ.get("COMPACTD_DATABASE_URL") or embedded_url())


def _include_name(name: str | None, type_: str, _parents: object) -> bool:
    return not (type_ in ("table", "index", "column") and unmanaged(name))


def _configure(connection: Connection) -> None:
    context.configure(connection=connection, target_metadata=target_metadata,
                      compare_type=True, render_as_batch=connection.dialect.name == "sqlite",
                      include_name=_include_name)
    with context.begin_transaction():
        context.run_migrations()


async def _run_online() -> None:
    engine = create_engine(_url(), pool_size=1)
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
