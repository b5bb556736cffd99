"""What every ``compactd`` command shares: its exit codes, how it prints (JSON or lines), the
store it opens and the URLs it names without their passwords.

Exit codes (DESIGN.md's): 0 success (including nothing_to_do), 1 a failed compaction (a partial
one too: it committed some of its steps, then failed; its outcome says so) or an operational
error (a database or a broker that cannot be reached), 2 bad input or usage.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import AsyncIterator
from typing import Any

from compactd.storage.database import database_exists, require_database
from compactd.storage.errors import SessionNotFound
from compactd.storage.migrate import open_schema
from compactd.storage.store import Store
from compactd.worker.settings import Config

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_CODES_HELP = ("exit status: 0 success (nothing to do included), 1 a failed compaction "
                   "(a partial one too: some of its steps committed, then it failed; its "
                   "outcome says which), a failed check or an unreachable database or broker, "
                   "2 bad input or usage")


@contextlib.asynccontextmanager
async def open_store(config: Config, *, reads: str | None = None, reads_all: bool = False
                     ) -> AsyncIterator[Store]:
    """A store on the configured database; the embedded SQLite file is migrated on first use
    (it has no operator to run ``compactd migrate``).

    ``reads``: the session a command that only reads asks for. On an embedded database that was
    never created no session is there, and creating and migrating the file to say so would be a
    write: :class:`SessionNotFound` instead, and no file. ``reads_all``: a command that only
    reads the whole database (``status``, ``verify --all``) is refused naming the missing file
    (:class:`DatabaseFileMissing`, exit 2): an empty answer would hide a mistyped path."""
    if reads is not None and not database_exists(config.database_url):
        raise SessionNotFound(reads)
    if reads_all:
        require_database(config.database_url)
    store = Store.from_url(config.database_url, pool_size=5,
                           statement_cache=config.database.statement_cache)
    await open_schema(store.engine, config.database_url)
    try:
        yield store
    finally:
        await store.close()


def emit(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, ensure_ascii=False, default=str) + "\n")


def say(text: str = "") -> None:
    sys.stdout.write(text + "\n")


def redact_url(url: str) -> str:
    """``url`` with its password replaced by ``***``."""
    if "@" in url and "://" in url:
        scheme, rest = url.split("://", 1)
        creds, host = rest.rsplit("@", 1)
        user = creds.split(":", 1)[0]
        return f"{scheme}://{user}:***@{host}" if ":" in creds else f"{scheme}://{user}@{host}"
    return url
