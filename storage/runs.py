"""Run records: what each compaction run did, for the loop guard, the CLI and the metrics.

A run row is written by the lease protocol (``storage.leases``: the claim starts it, the commit
or finish ends it, the reaper abandons it); this mixin only reads them.
"""

from __future__ import annotations

import datetime as dt
import functools
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from compactd.storage import schema as t
from compactd.storage.connectors import Connector
from compactd.storage.database import connection
from compactd.storage.kinds import RunStatus
from compactd.storage.leads import claim_to_checkpoint_s
from compactd.storage.records import RunRecord, SessionInfo
from compactd.storage.schema import (
    RUN_COLUMNS,
    SESSION_COLUMNS,
    run_from_record,
    run_from_row,
    session_from_row,
)


class RunsMixin:
    engine: AsyncEngine
    db: Connector

    async def get_run(self, run_id: str) -> RunRecord | None:
        async with connection(self.engine) as conn:
            row = (await conn.execute(sa.select(*RUN_COLUMNS)
                                      .where(t.compaction_runs.c.id == run_id))).first()
        return run_from_row(row) if row else None

    async def runs_for_task(self, task_id: str) -> list[RunRecord]:
        r = t.compaction_runs.c
        async with connection(self.engine) as conn:
            return [run_from_row(row) for row in await conn.execute(
                sa.select(*RUN_COLUMNS).where(r.task_id == task_id).order_by(r.started_at))]

    async def task_instructions(self, task_id: str) -> tuple[str, ...]:
        """The instructions the deliveries of the manual task ``task_id`` recorded on their
        run rows (:func:`recorded_instructions`)."""
        async with connection(self.engine) as conn:
            return await recorded_instructions(conn, task_id)

    async def session_runs(self, session_id: str, *, limit: int = 50) -> list[RunRecord]:
        r = t.compaction_runs.c
        async with connection(self.engine) as conn:
            return [run_from_row(row) for row in await conn.execute(
                sa.select(*RUN_COLUMNS).where(r.session_id == session_id)
                .order_by(r.started_at.desc(), r.id.desc()).limit(limit))]

    async def recent_runs(self, *, since: dt.datetime | None = None, limit: int = 50,
                          session_id: str | None = None, status: str | None = None,
                          trigger: str | None = None, leased: bool = False
                          ) -> list[RunRecord]:
        """The newest runs, newest first, of ``session_id``, ``status`` and ``trigger`` (the
        run's cause) when given; with ``leased``, only runs that held the session's lease (not
        the attempts that found it leased by another, which compacted nothing)."""
        if since is not None and since.tzinfo is None:
            # The raw statement below would read it as the server's local time.
            raise ValueError("naive datetime passed to storage; use aware UTC")
        if since is not None and session_id is not None and status and trigger is None \
                and not leased:
            # The loop guard's read after every committed automatic run: a named query, which
            # PostgreSQL runs without SQLAlchemy's statement layer.
            records = await self.db.fetch("session_runs", session_id=session_id, status=status,
                                          since=since, limit=limit)
            return [run_from_record(r) for r in records]
        stmt = _recent_runs(since is not None, session_id is not None, status is not None,
                            trigger is not None, leased, limit)
        params = {"b_since": since, "b_session": session_id, "b_status": status,
                  "b_trigger": trigger}
        async with connection(self.engine) as conn:
            return [run_from_row(row) for row in await conn.execute(stmt, params)]

    async def claim_to_commit_durations(self, model: str | None, *, since: dt.datetime,
                                        limit: int = 64) -> list[float]:
        """Seconds from the claim to the first checkpoint's commit (a committed run that
        recorded none: to its end) of the newest committed runs since ``since`` that wrote a
        summary with ``model``, and of the partial ones that committed a checkpoint before they
        failed, newest first; of every model's when none did (a provider may report its model
        under another name than the one configured). One statement, reading each status on
        its index."""
        rows = await self.db.recent_summary_runs((RunStatus.COMMITTED, RunStatus.PARTIAL),
                                                 since=since, limit=limit)
        spans = [(r["model"], span) for r in rows
                 if (span := claim_to_checkpoint_s(r["status"], r["stages"], r["started_at"],
                                                   r["finished_at"])) is not None]
        mine = [s for m, s in spans if m == model]
        return mine or [s for _, s in spans]

    async def run_counts(self, *, since: dt.datetime | None = None
                         ) -> dict[tuple[str, str | None], int]:
        """Runs by (status, failure_class)."""
        r = t.compaction_runs.c
        stmt = (sa.select(r.status, r.failure_class, sa.func.count())
                .group_by(r.status, r.failure_class))
        if since is not None:
            stmt = stmt.where(r.started_at >= since)
        async with connection(self.engine) as conn:
            return {(row[0], row[1]): int(row[2]) for row in await conn.execute(stmt)}

    async def last_errors(self, *, since: dt.datetime | None = None) -> dict[str, RunRecord]:
        """The newest failed or partial run of each failure class."""
        out: dict[str, RunRecord] = {}
        for status in (RunStatus.FAILED, RunStatus.PARTIAL):
            for run in await self.recent_runs(since=since, status=status, limit=500):
                newest = out.get(run.failure_class or "")
                if run.failure_class and (newest is None or run.started_at > newest.started_at):
                    out[run.failure_class] = run
        return out

    async def run_usages(self, *, session_id: str | None = None,
                         since: dt.datetime | None = None, limit: int | None = None
                         ) -> list[tuple[str, dict[str, Any]]]:
        """(session, usage) of the runs that billed a provider, newest first: what costs are
        computed from (``worker.cost``), at the prices of whoever reads them."""
        r = t.compaction_runs.c
        stmt = (sa.select(r.session_id, r.usage).where(r.usage.is_not(None))
                .order_by(r.started_at.desc(), r.id.desc()))
        if session_id is not None:
            stmt = stmt.where(r.session_id == session_id)
        if since is not None:
            stmt = stmt.where(r.started_at >= since)
        if limit is not None:
            stmt = stmt.limit(limit)
        async with connection(self.engine) as conn:
            return [(row[0], row[1]) for row in await conn.execute(stmt) if row[1]]

    async def live_leases(self, *, now: dt.datetime | None = None) -> list[SessionInfo]:
        c = t.sessions.c
        async with connection(self.engine) as conn:
            return [session_from_row(row) for row in await conn.execute(
                sa.select(*SESSION_COLUMNS).where(c.lease_run_id.is_not(None))
                .order_by(c.lease_expires_at))]


async def recorded_instructions(conn: AsyncConnection, task_id: str, *,
                                besides_run: str | None = None) -> tuple[str, ...]:
    """What the run rows of ``task_id`` (but ``besides_run``'s) were asked to focus on: each
    distinct text once, in the order the runs started. A manual task's delivery moves its
    instructions onto its row once it holds the lease (``Store.take_manual``): the task's next
    delivery finds them there, whether it takes them or hands them back."""
    r = t.compaction_runs.c
    stmt = sa.select(r.instructions).where(r.task_id == task_id).order_by(r.started_at)
    if besides_run is not None:
        stmt = stmt.where(r.id != besides_run)
    rows = (await conn.execute(stmt)).scalars().all()
    return tuple(dict.fromkeys(text for texts in rows for text in texts or ()))


@functools.lru_cache(maxsize=64)
def _recent_runs(since: bool, session: bool, status: bool, trigger: bool, leased: bool,
                 limit: int) -> Any:
    """The runs query of one filter shape, built once (the loop guard runs it after every
    committed automatic run)."""
    r = t.compaction_runs.c
    stmt = sa.select(*RUN_COLUMNS).order_by(r.started_at.desc(), r.id.desc()).limit(limit)
    if since:
        stmt = stmt.where(r.started_at >= sa.bindparam("b_since"))
    if session:
        stmt = stmt.where(r.session_id == sa.bindparam("b_session"))
    if status:
        stmt = stmt.where(r.status == sa.bindparam("b_status"))
    if trigger:
        stmt = stmt.where(r.trigger == sa.bindparam("b_trigger"))
    if leased:
        # A busy attempt's row has no fence: it never held the lease.
        stmt = stmt.where(r.fence.is_not(None))
    return stmt
