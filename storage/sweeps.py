"""Sweep selection: the sessions a sweep resolves thresholds for and enqueues."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from compactd.storage import schema as t
from compactd.storage.counters import floor_values, reaches
from compactd.storage.database import transaction
from compactd.storage.records import SessionInfo, utcnow
from compactd.storage.schema import OVER_SWEEP_FLOORS, SESSION_COLUMNS, dumps, session_from_row

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine


class SweepsMixin:
    engine: AsyncEngine

    async def resolve_sweep_thresholds(
            self, *, key: str, resolve: Callable[[SessionInfo], Mapping[str, int | None]],
            limit: int = 1000) -> int:
        """Store the thresholds of up to ``limit`` sessions not yet resolved under ``key`` (new
        sessions, changed policies, a changed configuration); how many it resolved. ``resolve``
        gives a session's floor per registered counter (``storage.counters``), stored where
        :func:`~storage.counters.floor_values` says, with whether the session's counts kept by
        name reach theirs.

        Rows other transactions hold are skipped: the next sweep resolves them. In steady state
        no row differs and this is one index probe."""
        c = t.sessions.c
        async with transaction(self.engine) as conn:
            rows = (await conn.execute(
                sa.select(*SESSION_COLUMNS)
                .where(sa.or_(c.sweep_key.is_(None), c.sweep_key < key, c.sweep_key > key))
                .limit(limit).with_for_update(skip_locked=True))).all()
            groups: dict[str, tuple[dict[str, Any], list[str]]] = {}
            for row in rows:
                info = session_from_row(row)
                values = floor_values(resolve(info))
                values["over_counts"] = reaches(info.counts, values["sweep_counts"])
                groups.setdefault(dumps(values), (values, []))[1].append(row.id)
            # Sessions share a few policies: one statement per distinct set of thresholds.
            for values, ids in groups.values():
                await conn.execute(t.sessions.update().where(c.id.in_(ids)).values(
                    sweep_key=key, **values))
        return len(rows)

    async def select_for_sweep(self, *, decide: Callable[[SessionInfo], bool],
                               now: dt.datetime | None = None, limit: int = 100,
                               after_id: str | None = None, fresh_signal_s: float = 30.0
                               ) -> tuple[list[SessionInfo], str | None]:
        """One bounded batch of the sweep, in id order from ``after_id``.

        Reads only sessions whose cached totals reach their stored thresholds (the partial
        indexes ``ix_sessions_over_trigger`` and ``ix_sessions_over_counts``), so its cost
        follows the sessions under pressure, not the table. Of those, sessions with a live
        lease, a live cool-down or a signal younger than ``fresh_signal_s`` (its task is
        probably still queued) are passed over in SQL, and rows
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
                .where(OVER_SWEEP_FLOORS, c.id > (after_id or ""),
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
