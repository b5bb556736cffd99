"""Bulk recompaction jobs (``compactd recompact``): a job, its items, and the result of each
item's run."""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from compactd.storage import schema as t
from compactd.storage.database import connection, transaction
from compactd.storage.kinds import ItemState, JobState, RunStatus
from compactd.storage.records import BulkJob, utcnow

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

_ITEM_INSERT_CHUNK = 1000


def bulk_item_state(outcome: str) -> ItemState:
    """What a bulk item becomes when its run ends with ``outcome``."""
    if outcome in (RunStatus.FAILED, RunStatus.PARTIAL):
        # A partial run did not do what the job asked of it either.
        return ItemState.FAILED
    return ItemState.SKIPPED if outcome == RunStatus.NOTHING_TO_DO else ItemState.DONE


class BulkJobsMixin:
    engine: AsyncEngine

    async def create_bulk_job(self, *, filter: dict[str, Any], session_ids: Sequence[str],
                              force: bool, rate_per_s: float | None,
                              now: dt.datetime | None = None) -> BulkJob:
        now = now or utcnow()
        job_id = uuid.uuid4().hex
        async with transaction(self.engine) as conn:
            await conn.execute(t.bulk_jobs.insert().values(
                id=job_id, filter=filter, state=JobState.RUNNING, force=force,
                rate_per_s=rate_per_s, matched=len(session_ids), created_at=now, updated_at=now))
            for i in range(0, len(session_ids), _ITEM_INSERT_CHUNK):
                await conn.execute(t.bulk_items.insert(), [
                    {"job_id": job_id, "session_id": sid, "state": ItemState.PENDING,
                     "updated_at": now} for sid in session_ids[i:i + _ITEM_INSERT_CHUNK]])
        job = await self.get_bulk_job(job_id)
        assert job is not None
        return job

    async def get_bulk_job(self, job_id: str) -> BulkJob | None:
        async with connection(self.engine) as conn:
            jobs = await self._bulk_jobs(conn, sa.select(t.bulk_jobs).where(
                t.bulk_jobs.c.id == job_id))
        return jobs[0] if jobs else None

    async def list_bulk_jobs(self, *, limit: int = 20) -> list[BulkJob]:
        async with connection(self.engine) as conn:
            return await self._bulk_jobs(conn, sa.select(t.bulk_jobs).order_by(
                t.bulk_jobs.c.created_at.desc()).limit(limit))

    async def _bulk_jobs(self, conn: AsyncConnection, stmt: Any) -> list[BulkJob]:
        rows = (await conn.execute(stmt)).all()
        if not rows:
            return []
        i = t.bulk_items.c
        counts: dict[str, dict[str, int]] = {}
        for job_id, state, n in await conn.execute(
                sa.select(i.job_id, i.state, sa.func.count())
                .where(i.job_id.in_([r.id for r in rows])).group_by(i.job_id, i.state)):
            counts.setdefault(job_id, {})[state] = int(n)
        out = []
        for r in rows:
            c = counts.get(r.id, {})
            done, failed = c.get(ItemState.DONE, 0), c.get(ItemState.FAILED, 0)
            skipped = c.get(ItemState.SKIPPED, 0)
            out.append(BulkJob(
                id=r.id, filter=r.filter, state=r.state, force=r.force, rate_per_s=r.rate_per_s,
                matched=r.matched, created_at=r.created_at, updated_at=r.updated_at,
                pending=c.get(ItemState.PENDING, 0), done=done, skipped=skipped, failed=failed,
                enqueued=c.get(ItemState.ENQUEUED, 0) + done + skipped + failed))
        return out

    async def bulk_items(self, job_id: str, *, states: Sequence[str], limit: int,
                         after_session: str | None = None) -> list[str]:
        i = t.bulk_items.c
        stmt = (sa.select(i.session_id).where(i.job_id == job_id, i.state.in_(list(states)))
                .order_by(i.session_id).limit(limit))
        if after_session is not None:
            stmt = stmt.where(i.session_id > after_session)
        async with connection(self.engine) as conn:
            return list((await conn.execute(stmt)).scalars().all())

    async def mark_bulk_items(self, job_id: str, session_ids: Sequence[str], state: str,
                              *, from_states: Sequence[str], now: dt.datetime | None = None
                              ) -> None:
        """Move the items still in one of ``from_states`` to ``state``.

        The condition is in the statement, so a state only moves the way the caller meant: an
        item a worker has ended meanwhile (done or failed) keeps its ending unless the caller
        names that state (a resume sending failed items again does, before it sends them)."""
        if ItemState.DONE in from_states:
            raise ValueError(f"a bulk item does not move from {list(from_states)} to {state}")
        now = now or utcnow()
        i = t.bulk_items.c
        async with transaction(self.engine) as conn:
            await conn.execute(
                t.bulk_items.update()
                .where(i.job_id == job_id, i.session_id.in_(list(session_ids)),
                       i.state.in_(list(from_states)))
                .values(state=state, updated_at=now))
            await conn.execute(t.bulk_jobs.update().where(t.bulk_jobs.c.id == job_id)
                               .values(updated_at=now))

    async def set_bulk_job_state(self, job_id: str, state: str) -> None:
        async with transaction(self.engine) as conn:
            await conn.execute(t.bulk_jobs.update().where(t.bulk_jobs.c.id == job_id)
                               .values(state=state, updated_at=utcnow()))
