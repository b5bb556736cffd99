"""Bulk recompaction jobs, sweep selection and loop-guard flags."""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from storage import schema as t
from storage.database import connection, transaction
from storage.kinds import ItemState, JobState, RunStatus
from storage.records import BulkJob, SessionInfo, utcnow
from storage.schema import (
    OVER_SWEEP_THRESHOLD,
    SESSION_COLUMNS,
    session_from_row,
    sweep_floor_values,
)

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

_ITEM_INSERT_CHUNK = 1000


def bulk_item_state(outcome: str) -> ItemState:
    """What a bulk item becomes when its run ends with ``outcome``."""
    if outcome == RunStatus.FAILED:
        return ItemState.FAILED
    return ItemState.SKIPPED if outcome == RunStatus.NOTHING_TO_DO else ItemState.DONE


class JobsMixin:
    engine: AsyncEngine

    # ---------------------------------------------------------------------------------------
    # bulk jobs

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

    # ---------------------------------------------------------------------------------------
    # sweeps

    async def resolve_sweep_thresholds(
            self, *, key: str, resolve: Callable[[SessionInfo], Mapping[str, int | None]],
            limit: int = 1000) -> int:
        """Store the thresholds of up to ``limit`` sessions not yet resolved under ``key`` (new
        sessions, changed policies, a changed configuration); how many it resolved. ``resolve``
        gives a session's floor per counter (``worker.compaction.kinds.Counter``), each stored
        in ``sessions.sweep_<counter>`` (:data:`storage.schema.SWEEP_FLOORS`).

        Rows other transactions hold are skipped: the next sweep resolves them. In steady state
        no row differs and this is one index probe."""
        c = t.sessions.c
        async with transaction(self.engine) as conn:
            rows = (await conn.execute(
                sa.select(*SESSION_COLUMNS)
                .where(sa.or_(c.sweep_key.is_(None), c.sweep_key < key, c.sweep_key > key))
                .limit(limit).with_for_update(skip_locked=True))).all()
            groups: dict[tuple[tuple[str, int | None], ...], list[str]] = {}
            for row in rows:
                floors = sweep_floor_values(resolve(session_from_row(row)))
                groups.setdefault(tuple(sorted(floors.items())), []).append(row.id)
            # Sessions share a few policies: one statement per distinct set of thresholds.
            for floors_key, ids in groups.items():
                await conn.execute(t.sessions.update().where(c.id.in_(ids)).values(
                    sweep_key=key, **dict(floors_key)))
        return len(rows)

    async def select_for_sweep(self, *, decide: Callable[[SessionInfo], bool],
                               now: dt.datetime | None = None, limit: int = 100,
                               after_id: str | None = None, fresh_signal_s: float = 30.0
                               ) -> tuple[list[SessionInfo], str | None]:
        """One bounded batch of the sweep, in id order from ``after_id``.

        Reads only sessions whose cached totals reach their stored thresholds (the partial index
        ``ix_sessions_over_trigger``), so its cost follows the sessions under pressure, not the
        table. Of those, sessions with a live lease, a live cool-down or a signal younger than
        ``fresh_signal_s`` (its task is probably still queued) are passed over in SQL, and rows
        other transactions hold are skipped (``SKIP LOCKED``); of the rest, those ``decide``
        accepts get a new signal mark and are returned for enqueueing. The second value is the
        id to continue from, None when no candidate is left.
        """
        now = now or utcnow()
        fresh = now - dt.timedelta(seconds=fresh_signal_s)
        c = t.sessions.c
        chosen: list[SessionInfo] = []
        async with transaction(self.engine) as conn:
            rows = (await conn.execute(
                sa.select(*SESSION_COLUMNS)
                .where(OVER_SWEEP_THRESHOLD, c.id > (after_id or ""),
                       sa.or_(c.lease_expires_at.is_(None), c.lease_expires_at <= now),
                       sa.or_(c.cooldown_until.is_(None), c.cooldown_until <= now),
                       sa.or_(c.signal_at.is_(None), c.signal_at <= fresh))
                .order_by(c.id).limit(limit).with_for_update(skip_locked=True))).all()
            chosen = [info for info in map(session_from_row, rows) if decide(info)]
            if chosen:
                await conn.execute(
                    t.sessions.update().where(c.id.in_([s.id for s in chosen]))
                    .values(signal_at=now))
        next_after = rows[-1].id if len(rows) == limit else None
        return chosen, next_after

    # ---------------------------------------------------------------------------------------
    # loop guard

    async def flag_session(self, session_id: str, *, reason: str, cooldown_until: dt.datetime,
                           now: dt.datetime | None = None) -> None:
        async with transaction(self.engine) as conn:
            await conn.execute(t.sessions.update().where(t.sessions.c.id == session_id).values(
                flagged_reason=reason, flagged_at=now or utcnow(),
                cooldown_until=cooldown_until))

    async def clear_flag(self, session_id: str) -> None:
        async with transaction(self.engine) as conn:
            await conn.execute(t.sessions.update().where(t.sessions.c.id == session_id).values(
                flagged_reason=None, flagged_at=None, cooldown_until=None))

    async def flagged_sessions(self) -> list[SessionInfo]:
        c = t.sessions.c
        async with connection(self.engine) as conn:
            return [session_from_row(r) for r in await conn.execute(
                sa.select(*SESSION_COLUMNS).where(c.flagged_reason.is_not(None))
                .order_by(c.flagged_at.desc()))]
