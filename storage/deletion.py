"""Deleting a session, retention's purges, and the log's export.

A session's rows are deleted in short transactions of at most ``batch`` rows each, never under
the session's row lock, so neither another session's appends nor this one's wait on a delete of
a long log. How the batches are spaced is the backend's (``Connector.deletion_pace``): on SQLite,
whose one writer at a time is every session's, each batch is sized to a few milliseconds and
followed by a pause in which the appends queued behind it go first.

First, in one short transaction on the session's row, the deletion takes the session's lease (a
claim then finds it busy) and moves the fence, so a run in flight can no longer commit: the run
is recorded ``cancelled`` and its holder finds its lease gone at its next renewal or commit.
Last, the session row goes with what was appended meanwhile (the foreign keys cascade), in one
transaction: the deletion takes effect there, and an append after it finds no session.

The tables are every table of the schema with a ``session_id`` column (``SESSION_TABLES``), so a
table added later is covered without a change here. The log (``events``) goes last: a deletion
that is interrupted leaves the session with part of its rows, and running it again finishes it.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, overload

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from compactd.storage import schema as t
from compactd.storage.connectors import Connector, DeletionPace
from compactd.storage.database import connection, snapshot, transaction
from compactd.storage.errors import SessionNotFound
from compactd.storage.kinds import FailureClass, NodeKind, RunStatus
from compactd.storage.messages import from_payload, without_reserved
from compactd.storage.records import SessionInfo, utcnow

# Rows one transaction of a deletion removes from one table: a few milliseconds of work,
# so a writer queued behind it (SQLite's database lock, a PostgreSQL page) waits no longer.
DELETE_BATCH_ROWS = 1000
# The lease a deletion holds while it runs, renewed by every batch: a deletion that dies is
# reaped like a stalled run, and the session is left for a second `compactd delete`.
DELETE_LEASE_S = 300.0
DELETER = "compactd delete"
DELETED_ERROR = "the session was deleted"

# Every table holding rows of a session besides the session row itself, the log last.
SESSION_TABLES: tuple[sa.Table, ...] = tuple(sorted(
    (table for table in t.metadata.sorted_tables
     if "session_id" in table.c and table is not t.sessions),
    key=lambda table: table is t.events))


@dataclass(frozen=True, slots=True)
class DeletionResult:
    session_id: str
    # Rows deleted per table (the session row under "sessions"), but for those appended during
    # the deletion that the final transaction's cascade removed.
    rows: dict[str, int] = field(default_factory=dict)
    cancelled_run: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"session": self.session_id, "deleted": True, "rows": dict(self.rows),
                "cancelled_run": self.cancelled_run}


@dataclass(frozen=True, slots=True)
class BeatRun:
    """The last run of a beat task that records itself (retention): when it ended and what it
    did."""

    name: str
    finished_at: dt.datetime
    result: dict[str, Any]


class DeletionMixin:
    engine: AsyncEngine
    db: Connector

    if TYPE_CHECKING:  # provided by Store
        async def _session(self, conn: AsyncConnection, session_id: str, *, lock: bool = False,
                           nowait: bool = False) -> SessionInfo: ...

    @overload
    async def delete_session(self, session_id: str, *, tenant: str | None = None,
                             batch: int = DELETE_BATCH_ROWS, now: dt.datetime | None = None
                             ) -> DeletionResult: ...

    @overload
    async def delete_session(self, session_id: str, *, tenant: str | None = None,
                             batch: int = DELETE_BATCH_ROWS, now: dt.datetime | None = None,
                             idle_before: dt.datetime) -> DeletionResult | None: ...

    async def delete_session(self, session_id: str, *, tenant: str | None = None,
                             batch: int = DELETE_BATCH_ROWS, now: dt.datetime | None = None,
                             idle_before: dt.datetime | None = None) -> DeletionResult | None:
        """Delete the session and every row of it. With ``tenant``, a session of another tenant
        is not found (and nothing is deleted). With ``idle_before`` (retention), only a session
        with no append since then and no live lease: None, and nothing deleted, for one that is
        not. SessionNotFound when there is none."""
        now = now or utcnow()
        try:
            cancelled = await self._begin_delete(session_id, tenant=tenant, now=now,
                                                 idle_before=idle_before)
        except _InUse:
            return None
        rows: dict[str, int] = {table.name: 0 for table in SESSION_TABLES}
        sizes = _BatchSizes(self.db.deletion_pace, batch)
        while True:
            # A pass over every table; appends meanwhile add rows, so passes go on until one
            # needs no more than a batch for any table, and the final transaction takes the rest.
            full = False
            for table in SESSION_TABLES:
                deleted, batches = await self._delete_rows(table, session_id, sizes)
                rows[table.name] += deleted
                full = full or batches > 1
                await self._renew_deletion(session_id, now=utcnow())
            if not full:
                break
        async with transaction(self.engine) as conn:
            for table in SESSION_TABLES:
                if table.c.session_id.foreign_keys:
                    continue  # the session row's cascade removes it
                result = await conn.execute(table.delete().where(
                    table.c.session_id == session_id))
                rows[table.name] += result.rowcount or 0
            result = await conn.execute(t.sessions.delete().where(t.sessions.c.id == session_id))
            rows["sessions"] = result.rowcount or 0
        return DeletionResult(session_id=session_id, rows=rows, cancelled_run=cancelled)

    async def _begin_delete(self, session_id: str, *, tenant: str | None, now: dt.datetime,
                            idle_before: dt.datetime | None) -> str | None:
        """Fence the session off: its run in flight ends ``cancelled``, its lease becomes the
        deletion's. The id of the run cancelled, if any."""
        c, r = t.sessions.c, t.compaction_runs.c
        async with transaction(self.engine) as conn:
            info = await self._session(conn, session_id, lock=True)
            if tenant is not None and info.tenant != tenant:
                raise SessionNotFound(session_id)
            if idle_before is not None and (
                    (info.last_append_at or info.created_at) >= idle_before
                    or (info.lease_expires_at is not None and info.lease_expires_at > now)):
                raise _InUse()
            cancelled = None
            if info.lease_run_id is not None:
                result = await conn.execute(
                    t.compaction_runs.update()
                    .where(r.id == info.lease_run_id, r.status == RunStatus.RUNNING)
                    .values(status=RunStatus.FAILED, failure_class=FailureClass.CANCELLED,
                            finished_at=now, error=DELETED_ERROR))
                cancelled = info.lease_run_id if result.rowcount else None
            await conn.execute(t.sessions.update().where(c.id == session_id).values(
                lease_owner=DELETER, lease_run_id=None, lease_fence=c.lease_fence + 1,
                lease_expires_at=now + dt.timedelta(seconds=DELETE_LEASE_S), signal_at=None))
        return cancelled

    async def _renew_deletion(self, session_id: str, *, now: dt.datetime) -> None:
        c = t.sessions.c
        async with transaction(self.engine) as conn:
            await conn.execute(t.sessions.update().where(c.id == session_id,
                                                          c.lease_owner == DELETER)
                               .values(lease_expires_at=now + dt.timedelta(
                                   seconds=DELETE_LEASE_S)))

    async def _delete_rows(self, table: sa.Table, session_id: str, sizes: _BatchSizes
                           ) -> tuple[int, int]:
        """Delete the session's rows of ``table`` batch by batch, each in its own transaction
        and followed by the backend's pause; (rows deleted, batches run)."""
        deleted = batches = 0
        while True:
            limit = sizes.rows(table)
            async with transaction(self.engine) as conn:
                # Timed from when the transaction holds the database, not from when it waited
                # for it: an append's turn is not the batch's cost.
                started = time.perf_counter()
                result = await conn.execute(_batch_delete(table), {"b_session": session_id,
                                                                   "b_batch": limit})
            done = result.rowcount or 0
            took = time.perf_counter() - started
            sizes.took(table, done, took)
            deleted += done
            batches += 1
            rest = sizes.pace.rest_after(took)
            if rest > 0:
                await asyncio.sleep(rest)
            if done < limit:
                return deleted, batches

    # ---------------------------------------------------------------------------------------
    # export

    async def export_messages(self, session_id: str, *, after_seq: int = 0, limit: int = 1000
                              ) -> list[tuple[int, dict[str, Any]]]:
        """A page of the session's log as appended: (seq, OpenAI chat dict) of its messages
        after ``after_seq``, oldest first; SessionNotFound when there is no such session."""
        e = t.events.c
        async with snapshot(self.engine) as conn:
            await self._session(conn, session_id)
            rows = (await conn.execute(
                sa.select(e.seq, e.payload)
                .where(e.session_id == session_id, e.seq > after_seq,
                       e.kind == NodeKind.MESSAGE)
                .order_by(e.seq).limit(limit))).all()
        return [(r.seq, from_payload(without_reserved(r.payload)).to_openai()) for r in rows]

    # ---------------------------------------------------------------------------------------
    # retention

    async def purge_originals(self, *, appended_before: dt.datetime, limit: int) -> int:
        """Delete up to ``limit`` recall originals whose message was appended before
        ``appended_before``, in one short transaction; how many."""
        async with transaction(self.engine) as conn:
            result = await conn.execute(_PURGE_ORIGINALS, {"b_before": appended_before,
                                                           "b_limit": limit})
            return result.rowcount or 0

    async def purge_append_keys(self, *, created_before: dt.datetime, limit: int) -> int:
        """Delete up to ``limit`` append idempotency keys stored before ``created_before``
        (expired: an append no longer answers from them), in one short transaction; how
        many."""
        async with transaction(self.engine) as conn:
            result = await conn.execute(_PURGE_APPEND_KEYS, {"b_before": created_before,
                                                             "b_limit": limit})
            return result.rowcount or 0

    async def idle_sessions(self, *, idle_before: dt.datetime, limit: int) -> list[str]:
        """Up to ``limit`` sessions with no append since ``idle_before`` (none at all: created
        before it) and no live lease, oldest first."""
        c = t.sessions.c
        last = sa.func.coalesce(c.last_append_at, c.created_at)
        async with connection(self.engine) as conn:
            return [r[0] for r in await conn.execute(
                sa.select(c.id).where(last < idle_before, sa.or_(
                    c.lease_expires_at.is_(None), c.lease_expires_at <= idle_before))
                .order_by(last).limit(limit))]

    async def record_beat_run(self, name: str, *, result: dict[str, Any],
                              now: dt.datetime | None = None) -> None:
        b = t.beat_runs
        values = {"name": name, "finished_at": now or utcnow(), "result": result}
        async with transaction(self.engine) as conn:
            updated = await conn.execute(b.update().where(b.c.name == name).values(**values))
            if not updated.rowcount:
                await conn.execute(b.insert().values(**values))

    async def beat_runs(self, names: Sequence[str] | None = None) -> list[BeatRun]:
        b = t.beat_runs.c
        stmt = sa.select(b.name, b.finished_at, b.result).order_by(b.name)
        if names is not None:
            stmt = stmt.where(b.name.in_(list(names)))
        async with connection(self.engine) as conn:
            return [BeatRun(r.name, r.finished_at, r.result or {})
                    for r in await conn.execute(stmt)]


class _BatchSizes:
    """The row count of a table's next batch: the deletion's own, or fitted to the pace's time
    per batch from the last batch of the same table (tables differ: a recall original also
    leaves the full-text index)."""

    # Below this a batch is mostly the transaction's own cost.
    MIN_ROWS = 200

    def __init__(self, pace: DeletionPace, batch: int) -> None:
        self.pace = pace
        self.batch = batch
        self._rows: dict[str, int] = {}

    def rows(self, table: sa.Table) -> int:
        return self._rows.get(table.name, self.batch)

    def took(self, table: sa.Table, deleted: int, seconds: float) -> None:
        if self.pace.batch_s is None or deleted < self.rows(table):
            return  # a partial batch is the table's last: nothing to fit
        fitted = int(deleted * self.pace.batch_s / max(seconds, 1e-6))
        # Grow at most twofold a batch: one fast batch (a warm cache) is not a new rate.
        self._rows[table.name] = max(min(self.batch, fitted, 2 * deleted),
                                     min(self.MIN_ROWS, self.batch))


class _InUse(Exception):
    """The session appended or took a lease since retention picked it."""


def _batch_delete(table: sa.Table) -> Any:
    """At most ``b_batch`` of the session's rows of ``table``, by primary key; the outer
    session_id keeps both backends on the primary-key index."""
    session = table.c.session_id == sa.bindparam("b_session")
    key = list(table.primary_key.columns)
    chosen = sa.select(*key).where(session).limit(sa.bindparam("b_batch"))
    by_key = key[0].in_(chosen) if len(key) == 1 else sa.tuple_(*key).in_(chosen)
    return table.delete().where(session, by_key)


_o, _e = t.recall_originals.c, t.events.c
_PURGE_ORIGINALS = t.recall_originals.delete().where(sa.tuple_(_o.session_id, _o.seq).in_(
    sa.select(_o.session_id, _o.seq)
    .join(t.events, sa.and_(_e.session_id == _o.session_id, _e.seq == _o.seq))
    .where(_e.created_at < sa.bindparam("b_before"))
    .limit(sa.bindparam("b_limit"))))

_k = t.append_keys.c
_PURGE_APPEND_KEYS = t.append_keys.delete().where(sa.tuple_(_k.session_id, _k.key).in_(
    sa.select(_k.session_id, _k.key).where(_k.created_at < sa.bindparam("b_before"))
    .limit(sa.bindparam("b_limit"))))
