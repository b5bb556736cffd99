"""The lease protocol's storage half: claim, renew, commit, finish, reap.

A transaction is never held across a model call. A claim locks the session row for one short
transaction (``FOR UPDATE``, waiting briefly for another short one to end), writes the lease
(owner, expiry, a new fence), the run row and ``compaction/start``, and commits. The commit
locks the row again, checks the fence is still ours and the surface is still what the plan
read, applies the replace, journals, and writes ``compaction/end`` last, so a crash leaves a
detectable orphan start, never a false end.
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from compactd.storage import schema as t
from compactd.storage.connectors_general import (
    CLAIM_LOCK_WAIT_S,
    abandon_run,
    close_abandoned,
    row_stayed_locked,
    write_end,
)
from compactd.storage.database import deadline_left_s, transaction
from compactd.storage.errors import DeadlinePassed
from compactd.storage.events import EventKind, run_end_event
from compactd.storage.records import (
    Busy,
    Claim,
    ReapedLease,
    Replacement,
    RunEnd,
    SessionInfo,
    Skipped,
    utcnow,
)

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

    from compactd.storage.connectors import Connector

__all__ = ["CLAIM_LOCK_WAIT_S", "REAPER", "LeasesMixin", "check_replacements"]

# Who ends an expired lease's run (its journal's ``closed_by``); an operator's release names
# whoever released it instead.
REAPER = "reaper"


class LeasesMixin:
    engine: AsyncEngine
    db: Connector

    if TYPE_CHECKING:  # provided by Store
        async def _session(self, conn: AsyncConnection, session_id: str, *, lock: bool = False,
                           nowait: bool = False) -> SessionInfo: ...

    # ---------------------------------------------------------------------------------------
    # claim

    async def claim(self, session_id: str, *, owner: str, trigger: str, lease_s: float,
                    now: dt.datetime | None = None, task_id: str | None = None,
                    bulk_job_id: str | None = None) -> Claim | Busy | Skipped:
        """Take the lease on a session, or record a ``busy`` attempt when another run's lease
        is live.

        A session row another transaction holds is waited for (``CLAIM_LOCK_WAIT_S``, less when
        the run's deadline comes first): such transactions are short, and the claim goes on
        when the row is free. :class:`LockNotAvailable` when it stays locked for the whole
        wait.
        """
        try:
            return await self.db.claim(session_id, run_id=uuid.uuid4().hex, owner=owner,
                                       trigger=trigger, lease_s=lease_s, now=now or utcnow(),
                                       task_id=task_id, bulk_job_id=bulk_job_id)
        except DeadlinePassed:
            left = deadline_left_s()
            if left is None or left <= 0:
                raise
            # A lock wait ended, but by the claim's own bound, not the run's deadline.
            raise row_stayed_locked(session_id) from None

    # ---------------------------------------------------------------------------------------
    # renew

    async def renew(self, session_id: str, *, run_id: str, fence: int, lease_s: float,
                    now: dt.datetime | None = None) -> bool:
        """Extend a lease we still hold; False when the fence moved (the lease is lost)."""
        now = now or utcnow()
        c = t.sessions.c
        async with transaction(self.engine) as conn:
            result = await conn.execute(
                t.sessions.update()
                .where(c.id == session_id, c.lease_fence == fence, c.lease_run_id == run_id)
                .values(lease_expires_at=now + dt.timedelta(seconds=lease_s)))
            if not result.rowcount:
                return False
            await conn.execute(t.compaction_runs.update()
                               .where(t.compaction_runs.c.id == run_id)
                               .values(heartbeat_at=now))
        return True

    # ---------------------------------------------------------------------------------------
    # commit

    async def commit(self, session_id: str, *, run_id: str, fence: int,
                     replacements: Sequence[Replacement],
                     expected: Sequence[tuple[int, int]] | None = None,
                     end: RunEnd | None = None, now: dt.datetime | None = None) -> SessionInfo:
        """Apply replacements under our fence; with ``end``, finish the run in the same commit.

        ``expected`` is the ``(position, seq)`` prefix of the surface the plan read, through the
        last node it replaces. Appends after it are fine (they stay after the checkpoint); any
        other difference raises :class:`SurfaceChanged` and nothing is modified. A moved fence
        raises :class:`LeaseLost`.
        """
        now = now or utcnow()
        check_replacements(replacements)
        return await self.db.commit(session_id, run_id=run_id, fence=fence,
                                    replacements=replacements, expected=expected, end=end,
                                    now=now)

    async def finish(self, session_id: str, *, run_id: str, fence: int, end: RunEnd,
                     now: dt.datetime | None = None) -> bool:
        """End a claimed run without replacing anything. False when the lease was lost, in
        which case the run is recorded as abandoned and the journal is left to its new owner.
        A failed run's end sends ``compaction.failed`` in the same transaction."""
        now = now or utcnow()
        async with transaction(self.engine) as conn:
            info = await self._session(conn, session_id, lock=True)
            if info.lease_fence == fence and info.lease_run_id == run_id:
                await write_end(conn, session_id, run_id, info.last_seq + 1, end, now)
                event = run_end_event(session_id, info.tenant, run_id,
                                      version=info.surface_version, seq=info.last_seq + 1,
                                      status=end.outcome, failure_class=end.failure_class)
                # A committed end's event went with its commit.
                if event is not None and event.event == EventKind.FAILED:
                    await self.db.notify(event, conn=conn)
                return True
            await abandon_run(conn, run_id, now, "lease lost before the run ended "
                              f"({end.failure_class or end.outcome})")
            return False

    # ---------------------------------------------------------------------------------------
    # reap

    async def reap_expired(self, *, now: dt.datetime | None = None, limit: int = 100,
                           by: str = REAPER) -> list[ReapedLease]:
        """Close expired leases: the run becomes ``abandoned`` and its orphan start is ended."""
        now = now or utcnow()
        c = t.sessions.c
        reaped: list[ReapedLease] = []
        async with transaction(self.engine) as conn:
            rows = (await conn.execute(
                sa.select(c.id).where(c.lease_expires_at.is_not(None), c.lease_expires_at <= now)
                .order_by(c.lease_expires_at).limit(limit)
                .with_for_update(skip_locked=True))).scalars().all()
            for session_id in rows:
                info = await self._session(conn, session_id)
                reaped.append(await self._reap(conn, info, now=now, by=by))
        return reaped

    async def release_lease(self, session_id: str, *, run_id: str | None = None,
                            now: dt.datetime | None = None, by: str = "operator"
                            ) -> ReapedLease | None:
        """End a session's lease now, expired or not, as the reaper ends an expired one: the run
        becomes ``abandoned`` and its orphan start is closed. Its holder, if alive, finds the
        lease gone at its next renewal or commit and stops. ``run_id`` makes sure the lease
        released is the one the operator looked at. None when there is no such lease."""
        now = now or utcnow()
        async with transaction(self.engine) as conn:
            info = await self._session(conn, session_id, lock=True)
            if info.lease_run_id is None or run_id not in (None, info.lease_run_id):
                return None
            return await self._reap(conn, info, now=now, by=by,
                                    error=f"lease of {info.lease_owner} released by {by}")

    async def _reap(self, conn: AsyncConnection, info: SessionInfo, *, now: dt.datetime,
                    by: str, error: str | None = None) -> ReapedLease:
        await close_abandoned(conn, info, seq=info.last_seq + 1, now=now, by=by, error=error)
        await conn.execute(t.sessions.update().where(t.sessions.c.id == info.id).values(
            last_seq=info.last_seq + 1, lease_owner=None, lease_run_id=None,
            lease_expires_at=None))
        return ReapedLease(session_id=info.id, run_id=info.lease_run_id, owner=info.lease_owner,
                           expired_at=info.lease_expires_at)


def check_replacements(replacements: Sequence[Replacement]) -> None:
    """ValueError for replacements no commit can apply, before anything is read."""
    wanted = [q for rep in replacements for q in rep.seqs]
    if len(set(wanted)) != len(wanted):
        raise ValueError("a seq is named by more than one replacement")
    replaced: set[int] = set()
    for rep in replacements:
        if rep.before is not None and rep.after is not None:
            raise ValueError("a replacement is placed before a node or after one, not both")
        if rep.after is not None and rep.seqs:
            raise ValueError("a replacement placed after a node replaces nothing")
        if not rep.seqs and rep.after is None:
            raise ValueError("a replacement must name at least one seq")
        if rep.keeps and rep.placed:
            raise ValueError("a replacement that keeps nodes is not placed")
        if set(rep.keeps) & set(rep.seqs) or len(set(rep.keeps)) != len(rep.keeps):
            raise ValueError("a replacement keeps a seq it replaces, or one seq twice")
        # Replacements apply in order, so that seq is gone; PostgreSQL checks unplaced ones on
        # the surface as the commit found it and would write a log that does not replay.
        if set(rep.keeps) & replaced:
            raise ValueError("a replacement keeps a seq an earlier replacement replaces")
        replaced.update(rep.seqs)
