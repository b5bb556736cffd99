"""The lease protocol's storage half: claim, renew, commit, finish, reap; and run records.

A transaction is never held across a model call. A claim locks the session row for one short
transaction (``FOR UPDATE``, waiting briefly for another short one to end), writes the lease
(owner, expiry, a new fence), the run row and ``compaction/start``, and commits. The commit
locks the row again, checks the fence is still ours and the surface is still what the plan
read, applies the replace, journals, and writes ``compaction/end`` last, so a crash leaves a
detectable orphan start, never a false end.
"""

from __future__ import annotations

import datetime as dt
import functools
import itertools
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from storage import schema as t
from storage.database import (
    KeptConnections,
    connection,
    deadline_left_s,
    driver_error,
    transaction,
)
from storage.errors import (
    CompactdError,
    DeadlinePassed,
    LeaseLost,
    LockNotAvailable,
    SurfaceChanged,
)
from storage.jobs import ITEM_DONE, bulk_item_state
from storage.records import (
    Busy,
    Claim,
    ReapedLease,
    Replacement,
    RunEnd,
    RunRecord,
    SessionInfo,
    Skipped,
    utcnow,
)
from storage.schema import (
    RUN_COLUMNS,
    SESSION_COLUMNS,
    dumps,
    run_from_record,
    run_from_row,
    session_from_record,
    session_from_row,
)
from storage.surface import JOURNAL_END, JOURNAL_START, commit_seqs

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

# How long a targeted claim waits for the session row another transaction holds (an append, a
# usage report, another claim, a commit: each for milliseconds), in the row's lock queue; the
# run's deadline ends the wait sooner. compactd_claim has the same wait (migration 0008).
CLAIM_LOCK_WAIT_S = 5.0

RUN_RUNNING = "running"
RUN_FAILED = "failed"



class LeasesMixin:
    engine: AsyncEngine
    sqlite: bool
    _kept: KeptConnections

    if TYPE_CHECKING:  # provided by Store and JobsMixin
        async def _session(self, conn: AsyncConnection, session_id: str, *, lock: bool = False,
                           nowait: bool = False, skip_locked: bool = False) -> SessionInfo: ...

        async def _bulk_item_done(self, conn: AsyncConnection, job_id: str, session_id: str
                                  ) -> bool: ...

        async def _settle_bulk_item(self, conn: AsyncConnection, run_id: str, session_id: str,
                                    outcome: str, now: dt.datetime) -> None: ...

    # ---------------------------------------------------------------------------------------
    # claim

    async def claim(self, session_id: str, *, owner: str, trigger: str, lease_s: float,
                    now: dt.datetime | None = None, task_id: str | None = None,
                    bulk_job_id: str | None = None, skip_locked: bool = False
                    ) -> Claim | Busy | Skipped:
        """Take the lease on a session, or record a ``busy`` attempt when another run's lease
        is live.

        A session row another transaction holds is waited for (``CLAIM_LOCK_WAIT_S``, less when
        the run's deadline comes first): such transactions are short, and the claim goes on
        when the row is free. :class:`LockNotAvailable` when it stays locked for the whole
        wait. ``skip_locked`` is for sweeps: a row another transaction holds is skipped at once.
        """
        try:
            return await self._claim_once(session_id, owner=owner, trigger=trigger,
                                          lease_s=lease_s, now=now or utcnow(), task_id=task_id,
                                          bulk_job_id=bulk_job_id, skip_locked=skip_locked)
        except DeadlinePassed:
            left = deadline_left_s()
            if left is None or left <= 0:
                raise
            # A lock wait ended, but by the claim's own bound, not the run's deadline.
            raise _row_stayed_locked(session_id) from None
        except LockNotAvailable:
            if self.sqlite:
                raise  # the database's write lock, waited for as every write waits for it
            raise _row_stayed_locked(session_id) from None

    async def _claim_once(self, session_id: str, *, owner: str, trigger: str, lease_s: float,
                          now: dt.datetime, task_id: str | None, bulk_job_id: str | None,
                          skip_locked: bool) -> Claim | Busy | Skipped:
        run_id = uuid.uuid4().hex
        if not self.sqlite and bulk_job_id is None:
            claimed = await self._claim_free_pg(session_id, run_id=run_id, owner=owner,
                                                trigger=trigger, lease_s=lease_s, now=now,
                                                task_id=task_id, skip_locked=skip_locked)
            if claimed is not None:
                return claimed
        async with transaction(self.engine) as conn:
            if not self.sqlite and not skip_locked:
                left = deadline_left_s()
                wait_s = CLAIM_LOCK_WAIT_S if left is None else min(CLAIM_LOCK_WAIT_S, left)
                await conn.execute(_LOCK_WAIT, {"ms": f"{max(1, int(wait_s * 1000))}ms"})
            info = await self._session(conn, session_id, lock=True, skip_locked=skip_locked)
            if bulk_job_id is not None and await self._bulk_item_done(conn, bulk_job_id,
                                                                      session_id):
                # Checked under the row lock that the committing run also takes, so a bulk
                # item delivered twice is compacted once.
                return Skipped(reason=f"bulk job {bulk_job_id} already finished this session")
            if info.lease_live(now):
                await self._insert_run(
                    conn, run_id, session_id, trigger=trigger, owner=owner, fence=None,
                    task_id=task_id, bulk_job_id=bulk_job_id, version=info.surface_version,
                    now=now, status=RUN_FAILED, failure_class="busy",
                    error=f"leased by {info.lease_owner} until {info.lease_expires_at}")
                return Busy(run_id=run_id, holder=info.lease_owner,
                            expires_at=info.lease_expires_at)
            seq = info.last_seq
            if info.lease_run_id is not None:
                # An expired lease the reaper has not reached yet: close it the same way.
                seq += 1
                await self._close_abandoned(conn, info, seq=seq, now=now, by=owner)
            fence = info.lease_fence + 1
            expires = now + dt.timedelta(seconds=lease_s)
            seq += 1
            await conn.execute(_INSERT_EVENTS, {
                "session_id": session_id, "seq": seq, "kind": JOURNAL_START, "run_id": run_id,
                "created_at": now, "tokens": None,
                "payload": {"run_id": run_id, "trigger": trigger, "owner": owner,
                            "fence": fence, "surface_version": info.surface_version}})
            row = (await conn.execute(_CLAIM_UPDATE, {
                "b_id": session_id, "b_last_seq": seq, "b_owner": owner, "b_run": run_id,
                "b_expires": expires, "b_fence": fence})).one()
            await self._insert_run(conn, run_id, session_id, trigger=trigger, owner=owner,
                                   fence=fence, task_id=task_id, bulk_job_id=bulk_job_id,
                                   version=info.surface_version, now=now, status=RUN_RUNNING)
            info = session_from_row(row)
        return Claim(session=info, run_id=run_id, fence=fence, owner=owner, expires_at=expires)

    async def _claim_free_pg(self, session_id: str, *, run_id: str, owner: str, trigger: str,
                             lease_s: float, now: dt.datetime, task_id: str | None,
                             skip_locked: bool) -> Claim | None:
        """The claim of a session with no lease, as one call of ``compactd_claim`` (migration
        0003); None when the session is leased or has an expired lease to close, which the
        general path handles. A bulk item always takes the general path (it checks the job)."""
        expires = now + dt.timedelta(seconds=lease_s)
        async with self._kept.use() as raw:
            row = await raw.fetchrow(_CLAIM_SQL, session_id, run_id, owner, trigger, expires,
                                     now, task_id, skip_locked)
        info = session_from_record(row)
        if info.lease_run_id != run_id:
            return None
        return Claim(session=info, run_id=run_id, fence=info.lease_fence, owner=owner,
                     expires_at=expires)

    async def _insert_run(self, conn: AsyncConnection, run_id: str, session_id: str, *,
                          trigger: str, owner: str, fence: int | None, task_id: str | None,
                          bulk_job_id: str | None, version: int, now: dt.datetime, status: str,
                          failure_class: str | None = None, error: str | None = None) -> None:
        finished = None if status == RUN_RUNNING else now
        await conn.execute(_INSERT_RUN, {
            "id": run_id, "session_id": session_id, "trigger": trigger, "status": status,
            "failure_class": failure_class, "owner": owner, "fence": fence, "task_id": task_id,
            "bulk_job_id": bulk_job_id, "surface_version_at_start": version, "error": error,
            "started_at": now, "heartbeat_at": now, "finished_at": finished})

    async def _close_abandoned(self, conn: AsyncConnection, info: SessionInfo, *, seq: int,
                               now: dt.datetime, by: str, error: str | None = None) -> None:
        """Journal the end of an expired lease's run and mark the run abandoned."""
        run_id = info.lease_run_id
        await conn.execute(t.events.insert().values(
            session_id=info.id, seq=seq, kind=JOURNAL_END, run_id=run_id, created_at=now,
            payload={"run_id": run_id, "outcome": RUN_FAILED, "failure_class": "abandoned",
                     "closed_by": by, "lease_owner": info.lease_owner,
                     "lease_expired_at": _iso(info.lease_expires_at)}))
        await conn.execute(
            t.compaction_runs.update()
            .where(t.compaction_runs.c.id == run_id,
                   t.compaction_runs.c.status == RUN_RUNNING)
            .values(status=RUN_FAILED, failure_class="abandoned", finished_at=now,
                    error=error or (f"lease of {info.lease_owner} expired at "
                                    f"{_iso(info.lease_expires_at)}")))

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
        wanted = [q for rep in replacements for q in rep.seqs]
        if len(set(wanted)) != len(wanted):
            raise ValueError("a seq is named by more than one replacement")
        if any(not rep.seqs for rep in replacements):
            raise ValueError("a replacement must name at least one seq")
        if not self.sqlite:
            return await self._commit_pg(session_id, run_id=run_id, fence=fence,
                                         replacements=replacements, wanted=wanted,
                                         expected=expected, end=end, now=now)
        async with transaction(self.engine) as conn:
            info = await self._session(conn, session_id, lock=True)
            if info.lease_fence != fence or info.lease_run_id != run_id:
                raise _lease_lost(session_id, run_id, fence, info.lease_fence)
            replaced = None
            if expected:
                upto = max(pos for pos, _ in expected)
                prefix = (await conn.execute(_PREFIX, {"b_session": session_id,
                                                       "b_upto": upto})).all()
                if [(r.position, r.seq) for r in prefix] != [tuple(x) for x in expected]:
                    raise _prefix_changed(session_id, run_id)
                replaced = _rows_in_prefix(prefix, replacements)
            if replaced is None:
                replaced = await self._replaced_rows(conn, session_id, replacements, wanted)
            seq = info.last_seq
            d_tokens = d_nodes = 0
            events: list[dict[str, Any]] = []
            nodes: list[dict[str, Any]] = []
            for rep, rows, (journal_seq, seq) in zip(
                    replacements, replaced, commit_seqs(info.last_seq, len(replacements)),
                    strict=True):
                # Journal entry, then the node, per replacement: the same seqs as one at a time.
                events.append({"session_id": session_id, "seq": journal_seq,
                               "kind": rep.journal_kind, "run_id": run_id, "created_at": now,
                               "tokens": None, "payload": _journal_payload(rep, run_id)})
                events.append({"session_id": session_id, "seq": seq, "kind": rep.kind,
                               "run_id": run_id, "created_at": now, "tokens": rep.tokens,
                               "payload": _node_payload(rep, run_id)})
                nodes.append({"session_id": session_id, "position": rows[0].position,
                              "seq": seq, "tokens": rep.tokens})
                d_tokens += rep.tokens - sum(r.tokens for r in rows)
                d_nodes += 1 - len(rows)
            if end is not None:
                # compaction/end is the last event, in the same transaction as the checkpoint.
                seq += 1
                events.append(_end_event(session_id, run_id, seq, end, now))
            # A handful of statements however many replacements (a prune commit has one per
            # large tool result): the commit holds the session row, and appends wait on it.
            if events:
                await conn.execute(_INSERT_EVENTS, events)
            if replacements:
                await conn.execute(_DELETE_NODES, {"b_session": session_id, "b_seqs": wanted})
                await conn.execute(_INSERT_NODES, nodes)
            row = (await conn.execute(
                _commit_update(bool(replacements), end is not None),
                {"b_id": session_id, "b_last_seq": seq, "b_tokens": d_tokens,
                 "b_nodes": d_nodes})).one()
            if end is not None:
                await self._end_run(conn, session_id, run_id, end, now)
            return session_from_row(row)

    async def _commit_pg(self, session_id: str, *, run_id: str, fence: int,
                         replacements: Sequence[Replacement], wanted: list[int],
                         expected: Sequence[tuple[int, int]] | None, end: RunEnd | None,
                         now: dt.datetime) -> SessionInfo:
        """The commit as one statement, in autocommit: a call of ``compactd_commit`` (migration
        0004), and with ``end`` the run row's result and its bulk item's in the same statement
        (``_COMMIT_ENDING_SQL``). As a transaction around the call that was three more round
        trips (BEGIN, the run row, COMMIT), with appends waiting on the session row meanwhile."""
        args = (
            session_id, run_id, fence, now, wanted,
            [len(rep.seqs) for rep in replacements], [rep.kind for rep in replacements],
            [dumps(_node_payload(rep, run_id)) for rep in replacements],
            [rep.tokens for rep in replacements], [rep.journal_kind for rep in replacements],
            [dumps(_journal_payload(rep, run_id)) for rep in replacements],
            [pos for pos, _ in expected] if expected else None,
            [seq for _, seq in expected] if expected else None,
            dumps(_end_payload(run_id, end)) if end is not None else None)

        def failed(exc: BaseException) -> CompactdError | None:
            """compactd's own error for the function's SQLSTATEs; None for any other error,
            which the caller re-raises for the usual translation (CD404 included)."""
            pg = driver_error(exc)
            code, detail = getattr(pg, "sqlstate", None), getattr(pg, "detail", None) or ""
            if code == "CD409":
                return _lease_lost(session_id, run_id, fence, detail)
            if code == "CD410":
                if detail == "prefix":
                    return _prefix_changed(session_id, run_id)
                what, _, index = detail.partition(":")
                return _run_changed(replacements[int(index) - 1].seqs,
                                    contiguous=what == "contiguous")
            return None

        sql = _COMMIT_SQL
        ending: tuple[Any, ...] = ()
        if end is not None:
            sql = _COMMIT_ENDING_SQL
            ending = (*(_json_or_none(value) if column in _RUN_JSON_COLUMNS else value
                        for column, value in _run_end_values(end).items()),
                      bulk_item_state(end.outcome))
        async with self._kept.use() as raw:
            try:
                record = await raw.fetchrow(sql, *args, *ending)
            except Exception as exc:
                mapped = failed(exc)
                if mapped is None:
                    raise  # translated like every driver error (lock timeout, lost connection)
                raise mapped from None
        return session_from_record(record)

    async def _replaced_rows(self, conn: AsyncConnection, session_id: str,
                             replacements: Sequence[Replacement],
                             wanted: list[int]) -> list[list[Any]]:
        """The surface rows each replacement names, in order (``wanted``: all their seqs);
        :class:`SurfaceChanged` unless every one is on the surface, in that order, as one
        contiguous run."""
        if not wanted:
            return [[] for _ in replacements]
        found = {r.seq: r for r in await conn.execute(
            _ROWS_BY_SEQ, {"b_session": session_id, "b_seqs": wanted})}
        out: list[list[Any]] = []
        for rep in replacements:
            rows = [found[q] for q in rep.seqs if q in found]
            if not rows or len(rows) != len(rep.seqs) or any(
                    a.position >= b.position for a, b in itertools.pairwise(rows)):
                raise _run_changed(rep.seqs, contiguous=False)
            if len(rows) > 1:
                # All present and in order: contiguous when nothing else lies between them.
                between = (await conn.execute(_COUNT_BETWEEN, {
                    "b_session": session_id, "b_first": rows[0].position,
                    "b_last": rows[-1].position})).scalar()
                if between != len(rows):
                    raise _run_changed(rep.seqs, contiguous=True)
            out.append(rows)
        return out

    async def finish(self, session_id: str, *, run_id: str, fence: int, end: RunEnd,
                     now: dt.datetime | None = None) -> bool:
        """End a claimed run without replacing anything. False when the lease was lost, in
        which case the run is recorded as abandoned and the journal is left to its new owner."""
        now = now or utcnow()
        async with transaction(self.engine) as conn:
            info = await self._session(conn, session_id, lock=True)
            if info.lease_fence == fence and info.lease_run_id == run_id:
                await self._write_end(conn, session_id, run_id, info.last_seq + 1, end, now)
                return True
            await conn.execute(
                t.compaction_runs.update()
                .where(t.compaction_runs.c.id == run_id,
                       t.compaction_runs.c.status == RUN_RUNNING)
                .values(status=RUN_FAILED, failure_class="abandoned", finished_at=now,
                        error="lease lost before the run ended "
                              f"({end.failure_class or end.outcome})"))
            return False

    async def _write_end(self, conn: AsyncConnection, session_id: str, run_id: str, seq: int,
                         end: RunEnd, now: dt.datetime) -> None:
        await conn.execute(_INSERT_EVENTS, _end_event(session_id, run_id, seq, end, now))
        await conn.execute(_END_LEASE, {"b_id": session_id, "b_last_seq": seq})
        await self._end_run(conn, session_id, run_id, end, now)

    async def _end_run(self, conn: AsyncConnection, session_id: str, run_id: str, end: RunEnd,
                       now: dt.datetime) -> None:
        """The run row's result, and its bulk item's when it belongs to a bulk job."""
        job_id = (await conn.execute(_END_RUN, {
            "b_id": run_id, "b_now": now,
            **{f"b_{column}": value for column, value in _run_end_values(end).items()}})).scalar()
        if job_id is not None:
            await self._settle_bulk_item(conn, run_id, session_id, end.outcome, now)

    # ---------------------------------------------------------------------------------------
    # reap

    async def reap_expired(self, *, now: dt.datetime | None = None, limit: int = 100,
                           by: str = "reaper") -> list[ReapedLease]:
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
        await self._close_abandoned(conn, info, seq=info.last_seq + 1, now=now, by=by,
                                    error=error)
        await conn.execute(t.sessions.update().where(t.sessions.c.id == info.id).values(
            last_seq=info.last_seq + 1, lease_owner=None, lease_run_id=None,
            lease_expires_at=None))
        return ReapedLease(session_id=info.id, run_id=info.lease_run_id, owner=info.lease_owner,
                           expired_at=info.lease_expires_at)

    # ---------------------------------------------------------------------------------------
    # run records

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

    async def session_runs(self, session_id: str, *, limit: int = 50) -> list[RunRecord]:
        r = t.compaction_runs.c
        async with connection(self.engine) as conn:
            return [run_from_row(row) for row in await conn.execute(
                sa.select(*RUN_COLUMNS).where(r.session_id == session_id)
                .order_by(r.started_at.desc(), r.id.desc()).limit(limit))]

    async def recent_runs(self, *, since: dt.datetime | None = None, limit: int = 50,
                          session_id: str | None = None, status: str | None = None
                          ) -> list[RunRecord]:
        if since is not None and since.tzinfo is None:
            # The raw statement below would read it as the server's local time.
            raise ValueError("naive datetime passed to storage; use aware UTC")
        if not self.sqlite and since is not None and session_id is not None and status:
            # The loop guard's read after every committed automatic run: on a kept connection,
            # without SQLAlchemy's statement layer.
            async with self._kept.use() as raw:
                records = await raw.fetch(_SESSION_RUNS_SQL, session_id, status, since, limit)
            return [run_from_record(r) for r in records]
        stmt = _recent_runs(since is not None, session_id is not None, status is not None,
                            limit)
        params = {"b_since": since, "b_session": session_id, "b_status": status}
        async with connection(self.engine) as conn:
            return [run_from_row(row) for row in await conn.execute(stmt, params)]

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
        """The newest failed run of each failure class."""
        out: dict[str, RunRecord] = {}
        for run in await self.recent_runs(since=since, status=RUN_FAILED, limit=500):
            if run.failure_class and run.failure_class not in out:
                out[run.failure_class] = run
        return out

    async def live_leases(self, *, now: dt.datetime | None = None) -> list[SessionInfo]:
        c = t.sessions.c
        async with connection(self.engine) as conn:
            return [session_from_row(row) for row in await conn.execute(
                sa.select(*SESSION_COLUMNS).where(c.lease_run_id.is_not(None))
                .order_by(c.lease_expires_at))]


# The statements of the compaction hot path, built once: constructing a statement costs about as
# much CPU as executing it, and a worker runs dozens of compactions a second.
_s, _c, _r = t.surface.c, t.sessions.c, t.compaction_runs.c
_CLAIM_SQL = "SELECT * FROM compactd_claim($1, $2, $3, $4, $5, $6, $7, $8)"
# The general claim's wait for the row, to the end of its transaction (is_local).
_LOCK_WAIT = sa.text("SELECT set_config('lock_timeout', :ms, true)")
_COMMIT_SQL = ("SELECT * FROM compactd_commit($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, "
               "$13, $14)")
# The run row's result, column by column, as every way of ending a run writes it.
_RUN_END_COLUMNS = ("status", "failure_class", "error", "tokens_before", "tokens_after", "model",
                    "usage", "candidates", "stages", "range_seqs")
_RUN_JSON_COLUMNS = frozenset(c for c in _RUN_END_COLUMNS
                              if isinstance(t.compaction_runs.c[c].type, sa.JSON))


def _run_end_values(end: RunEnd) -> dict[str, Any]:
    values = {"status": end.outcome, "failure_class": end.failure_class, "error": end.error,
              "tokens_before": end.tokens_before, "tokens_after": end.tokens_after,
              "model": end.model, "usage": end.usage, "candidates": end.candidates,
              "stages": end.stages, "range_seqs": end.range_seqs}
    return {column: values[column] for column in _RUN_END_COLUMNS}


# The commit that ends its run: the run row's result and its bulk item's ride on the call.
# The UPDATE waits for the call (EXISTS on its result), so the session row is locked before the
# run row, as everywhere else, and a refused call (moved fence, changed surface) changes
# nothing. The call does not touch compaction_runs; the run row's UPDATE re-reads the row's
# newest version if a lease renewal changed it meanwhile, as any UPDATE does.
_COMMIT_ENDING_SQL = f"""
WITH c AS (SELECT * FROM compactd_commit($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12,
                                         $13, $14)),
     r AS (UPDATE compaction_runs
              SET {", ".join(f"{c} = ${i}" for i, c in enumerate(_RUN_END_COLUMNS, start=15))},
                  finished_at = $4, heartbeat_at = $4
            WHERE id = $2::text AND EXISTS (SELECT FROM c)
           RETURNING bulk_job_id),
     b AS (UPDATE bulk_items AS i SET state = ${15 + len(_RUN_END_COLUMNS)}, run_id = $2::text,
                  updated_at = $4
             FROM r
            WHERE i.job_id = r.bulk_job_id AND i.session_id = $1::text
              AND i.state <> '{ITEM_DONE}')
SELECT * FROM c
"""
_INSERT_EVENTS = t.events.insert()
_INSERT_RUN = t.compaction_runs.insert()
_END_LEASE = (t.sessions.update().where(_c.id == sa.bindparam("b_id"))
              .values(last_seq=sa.bindparam("b_last_seq"), lease_owner=None, lease_run_id=None,
                      lease_expires_at=None))
_INSERT_NODES = t.surface.insert()
_PREFIX = (sa.select(_s.position, _s.seq, _s.tokens)
           .where(_s.session_id == sa.bindparam("b_session"),
                  _s.position <= sa.bindparam("b_upto"))
           .order_by(_s.position))
_ROWS_BY_SEQ = (sa.select(_s.position, _s.seq, _s.tokens)
                .where(_s.session_id == sa.bindparam("b_session"),
                       _s.seq.in_(sa.bindparam("b_seqs", expanding=True))))
_COUNT_BETWEEN = (sa.select(sa.func.count()).select_from(t.surface)
                  .where(_s.session_id == sa.bindparam("b_session"),
                         _s.position >= sa.bindparam("b_first"),
                         _s.position <= sa.bindparam("b_last")))
_DELETE_NODES = t.surface.delete().where(
    _s.session_id == sa.bindparam("b_session"),
    _s.seq.in_(sa.bindparam("b_seqs", expanding=True)))
_CLAIM_UPDATE = (t.sessions.update().where(_c.id == sa.bindparam("b_id"))
                 .values(last_seq=sa.bindparam("b_last_seq"), lease_owner=sa.bindparam("b_owner"),
                         lease_run_id=sa.bindparam("b_run"),
                         lease_expires_at=sa.bindparam("b_expires"),
                         lease_fence=sa.bindparam("b_fence"))
                 .returning(*SESSION_COLUMNS))
_END_RUN = (t.compaction_runs.update().where(_r.id == sa.bindparam("b_id"))
            .values(**{c: sa.bindparam(f"b_{c}", type_=_r[c].type) for c in _RUN_END_COLUMNS},
                    finished_at=sa.bindparam("b_now"), heartbeat_at=sa.bindparam("b_now"))
            .returning(_r.bulk_job_id))


# _recent_runs(True, True, True, limit) as raw SQL, in the same order.
_SESSION_RUNS_SQL = ("SELECT * FROM compaction_runs WHERE session_id = $1 AND status = $2"
                     " AND started_at >= $3 ORDER BY started_at DESC, id DESC LIMIT $4")


@functools.lru_cache(maxsize=64)
def _recent_runs(since: bool, session: bool, status: bool, limit: int) -> Any:
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
    return stmt


@functools.cache
def _commit_update(replaced: bool, ended: bool) -> Any:
    """The session update of a commit: always the new last seq; with replacements the surface
    totals and version; with an end the lease cleared."""
    values: dict[str, Any] = {"last_seq": sa.bindparam("b_last_seq")}
    if replaced:
        values.update(surface_version=_c.surface_version + 1,
                      surface_tokens=_c.surface_tokens + sa.bindparam("b_tokens"),
                      surface_messages=_c.surface_messages + sa.bindparam("b_nodes"),
                      reported_input_tokens=None, reported_version=None)
    if ended:
        values.update(lease_owner=None, lease_run_id=None, lease_expires_at=None)
    return (t.sessions.update().where(_c.id == sa.bindparam("b_id")).values(**values)
            .returning(*SESSION_COLUMNS))


def _end_event(session_id: str, run_id: str, seq: int, end: RunEnd, now: dt.datetime
               ) -> dict[str, Any]:
    return {"session_id": session_id, "seq": seq, "kind": JOURNAL_END, "run_id": run_id,
            "created_at": now, "tokens": None, "payload": _end_payload(run_id, end)}


def _end_payload(run_id: str, end: RunEnd) -> dict[str, Any]:
    return {"run_id": run_id, "outcome": end.outcome, "failure_class": end.failure_class,
            "tokens_before": end.tokens_before, "tokens_after": end.tokens_after}


def _journal_payload(rep: Replacement, run_id: str) -> dict[str, Any]:
    return {"run_id": run_id, **rep.journal, "replaced_seqs": list(rep.seqs)}


def _node_payload(rep: Replacement, run_id: str) -> dict[str, Any]:
    return {"message": rep.payload, "replaces": list(rep.seqs), "run_id": run_id}


def _json_or_none(value: Any) -> str | None:
    return None if value is None else dumps(value)


def _lease_lost(session_id: str, run_id: str, fence: int, current: object) -> LeaseLost:
    return LeaseLost(f"run {run_id} lost its lease on {session_id!r} "
                     f"(fence {fence}, now {current})")


def _row_stayed_locked(session_id: str) -> LockNotAvailable:
    return LockNotAvailable(f"the row of session {session_id!r} stayed locked by another "
                            f"transaction for {CLAIM_LOCK_WAIT_S:g} s")


def _prefix_changed(session_id: str, run_id: str) -> SurfaceChanged:
    return SurfaceChanged(f"the surface of {session_id!r} changed under run {run_id}")


def _run_changed(seqs: Sequence[int], *, contiguous: bool) -> SurfaceChanged:
    if contiguous:
        return SurfaceChanged(f"seqs {list(seqs)} are no longer one contiguous run of the surface")
    return SurfaceChanged(f"seqs {list(seqs)} are no longer on the surface in that order")


def _rows_in_prefix(prefix: Sequence[Any], replacements: Sequence[Replacement]
                    ) -> list[list[Any]] | None:
    """Each replacement's rows, when the checked prefix holds them all: a replacement must be a
    consecutive run of it. None when some seq lies beyond the prefix (read them instead)."""
    index = {r.seq: i for i, r in enumerate(prefix)}
    out: list[list[Any]] = []
    for rep in replacements:
        if any(q not in index for q in rep.seqs):
            return None
        first = index[rep.seqs[0]]
        rows = list(prefix[first:first + len(rep.seqs)])
        if [r.seq for r in rows] != list(rep.seqs):
            return None  # the general check names what is wrong (order or a gap)
        out.append(rows)
    return out


def _iso(value: dt.datetime | None) -> str | None:
    return value.isoformat() if value else None
