"""``compactd lease release SESSION``: end a stuck lease now.

A lease whose holder died expires and the reaper ends it within ``worker.reap_interval_s``; this
is for the rest: a holder that keeps renewing but never finishes, or an operator who will not
wait. The run ends ``abandoned`` through the reaper's own storage path (``Store.release_lease``),
and the holder, if it is alive, finds its fence gone at its next renewal or commit and stops
without touching the surface. The session's signal mark is cleared so the next signal, or the
pressure sweep, can compact it again.
"""

from __future__ import annotations

import argparse
from typing import Any

from compactd.scheduler.output import emit, open_store, say
from compactd.worker.settings import Config


async def cmd_lease_release(args: argparse.Namespace, config: Config) -> int:
    async with open_store(config) as store:
        released = await store.release_lease(args.session, run_id=args.run, by=args.by)
        if released is not None:
            await store.clear_signal(args.session)
    body: dict[str, Any] = {"session": args.session, "released": released is not None,
                            "run_id": released.run_id if released else None,
                            "owner": released.owner if released else None,
                            "expires_at": released.expired_at.isoformat()
                            if released and released.expired_at else None}
    if args.json:
        emit(body)
    elif released is None:
        say(f"{args.session}: no lease" + (f" held by run {args.run}" if args.run else "")
            + "; nothing released")
    else:
        say(f"{args.session}: released the lease of run {released.run_id} "
            f"(held by {released.owner}); the run is abandoned")
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser("lease", help="operator actions on session leases")
    actions = p.add_subparsers(dest="lease_command", required=True, metavar="ACTION")
    r = actions.add_parser("release", help="end a session's lease now; its run is abandoned")
    r.add_argument("session", help="the session id")
    r.add_argument("--run", metavar="RUN_ID",
                   help="release only if this run still holds the lease (from compactd status)")
    r.add_argument("--by", default="operator", help="who released it, kept in the journal")
    r.add_argument("--json", action="store_true", help="print the result as JSON instead of text")
    r.set_defaults(handler=cmd_lease_release)
