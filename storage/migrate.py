"""Schema migrations: ``compactd migrate`` and the drift check."""

from __future__ import annotations

import asyncio
import sys
from importlib import resources
from typing import TYPE_CHECKING

from sqlalchemy.ext.asyncio import AsyncEngine

from compactd.storage.connectors_engines import backend_for_url
from compactd.storage.database import normalize_url, translated

if TYPE_CHECKING:
    from alembic.config import Config


# The newest revision; tests/migration checks it equals Alembic's head, so the embedded default
# can tell it is up to date with one query instead of loading Alembic on every command.
HEAD_REVISION = "0026"


def alembic_config(url: str) -> Config:
    from alembic.config import Config

    ini = resources.files("compactd.storage").joinpath("alembic.ini")
    # stdout as it is now: alembic binds its default when first imported, and a caller that
    # swapped sys.stdout then (a redirect, a test capture) may have closed that stream since.
    config = Config(str(ini), stdout=sys.stdout)
    config.attributes["url"] = normalize_url(url)
    return config


def upgrade(url: str, revision: str = "head") -> None:
    """Bring the database at ``url`` to ``revision`` (call from a thread without a running loop)."""
    from alembic import command

    with translated():
        command.upgrade(alembic_config(url), revision)


async def upgrade_async(url: str) -> None:
    await asyncio.to_thread(upgrade, url)


def check(url: str) -> None:
    """Raise when the models and the migrations disagree (``alembic check``)."""
    from alembic import command

    command.check(alembic_config(url))


async def open_schema(engine: AsyncEngine, url: str) -> None:
    """What opening the database at ``url`` does to its schema, before its first statement:
    the embedded SQLite file is migrated to head when it is behind (it has no operator); a
    server's is left to ``compactd migrate``."""
    await backend_for_url(url).open_schema(engine, url)


async def ensure_schema(engine: AsyncEngine, url: str) -> None:
    """Migrate the database to head when it is behind."""
    import sqlalchemy as sa

    from compactd.storage import sql

    try:
        async with engine.connect() as conn:
            current = (await conn.execute(sa.text(sql.NAMED_TEXT["schema_revision"]))).scalar()
    except Exception:
        current = None
    if current != HEAD_REVISION:
        await upgrade_async(url)

