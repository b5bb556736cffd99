"""CLI commands that take a session's data out: ``export`` (its log, as ``ingest`` reads it) and
``delete`` (all of it)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from compactd.scheduler.output import EXIT_OK, emit, open_store, say
from compactd.storage.schema import dumps
from compactd.worker.settings import Config

# Messages one read of an export returns: a session's log can be far larger than memory wants.
EXPORT_PAGE = 1000


async def cmd_export(args: argparse.Namespace, config: Config) -> int:
    """The session's messages in the order appended, one OpenAI chat JSON object per line (with
    its ``meta``): what ``compactd ingest`` reads, so an export ingested into a new session
    exports again byte for byte. Checkpoints and journal entries are compaction's, not the
    log's messages, and are not exported."""
    out = sys.stdout.buffer
    after = 0
    async with open_store(config, reads=args.session) as store:
        while True:
            page = await store.export_messages(args.session, after_seq=after,
                                               limit=EXPORT_PAGE)
            # Nothing is written before the first read: a missing session leaves no output.
            out.write(b"".join(dumps(message).encode() + b"\n" for _, message in page))
            if len(page) < EXPORT_PAGE:
                break
            after = page[-1][0]
    out.flush()
    return EXIT_OK


async def cmd_delete(args: argparse.Namespace, config: Config) -> int:
    # Imported here for start-up time: the client (and the planner it loads) only for delete.
    from compactd.scheduler.client import CompactdClient

    async with CompactdClient(config) as client:
        result = await client.delete(args.session, tenant=args.tenant)
    if args.json:
        emit(result.to_json())
        return EXIT_OK
    removed = sum(n for table, n in result.rows.items() if table != "sessions")
    cancelled = f"; its run {result.cancelled_run} was cancelled" if result.cancelled_run else ""
    say(f"deleted session {result.session_id} ({removed} rows){cancelled}")
    return EXIT_OK


def register(sub: Any) -> None:
    p = sub.add_parser("export", help="write a session's log as the JSON lines ingest reads")
    p.add_argument("session", help="the session id")
    p.set_defaults(handler=cmd_export)

    p = sub.add_parser("delete", help="delete a session and every row of it")
    p.add_argument("session", help="the session id")
    p.add_argument("--tenant", help="only if the session is this tenant's")
    p.add_argument("--json", action="store_true", help="print the result as JSON instead of text")
    p.set_defaults(handler=cmd_delete)
