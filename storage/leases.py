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
import functools
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from storage import schema as t
from storage.bulk_jobs import bulk_item_state
from storage.connectors import Connector
from storage.database import deadline_left_s, driver_error, transaction
from storage.errors import (
    CompactdError,
    DeadlinePassed,
    LeaseLost,
    LockNotAvailable,
    SurfaceChanged,
)
from storage.kinds import FailureClass, ItemState, JournalKind, RunStatus
from storage.recall_index import node_recall
from storage.records import (
    Busy,
    Claim,
    ReapedLease,
    Replacement,
    RunEnd,
    SessionInfo,
    Skipped,
    utcnow,
)
from storage.schema import SESSION_COLUMNS, dumps, session_from_record, session_from_row
from storage.surface import PlacementError, SurfaceRows, commit_seqs

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

# How long a targeted claim waits for the session row another transaction holds (an append, a
# usage report, another claim, a commit: each for milliseconds), in the row's lock queue; the
# run's deadline ends the wait sooner. compactd_claim has the same wait (its SET lock_timeout,
# storage/sql/functions/compactd_claim.sql).
CLAIM_LOCK_WAIT_S = 5.0

# Who ends an expired lease's run (its journal's ``closed_by``); an operator's release names
# whoever released it instead.
REAPER = "reaper"


class LeasesMixin:
    engine: AsyncEngine
    db: Connector

    if TYPE_CHECKING:  # provided by Store and BulkJobsMixin
        async def _session(self, conn: AsyncConnection, session_id: str, *, lock: bool = False,
                           nowait: bool = False) -> SessionInfo: ...

        async def _bulk_item_done(self, conn: AsyncConnection, job_id: str, session_id: str
                                  ) -> bool: ...

        async def _settle_bulk_item(self, conn: AsyncConnection, run_id: str, session_id: str,
                                    outcome: str, now: dt.datetime) -> None: ...

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
            return await self._claim_once(session_id, owner=owner, trigger=trigger,
                                          lease_s=lease_s, now=now or utcnow(), task_id=task_id,
                                          bulk_job_id=bulk_job_id)
        except DeadlinePassed:
            left = deadline_left_s()
            if left is None or left <= 0:
                raise
            # A lock wait ended, but by the claim's own bound, not the run's deadline.
            raise _row_stayed_locked(session_id) from None
        except LockNotAvailable:
            if not self.db.locks_rows:
                raise  # the database's write lock, waited for as every write waits for it
            raise _row_stayed_locked(session_id) from None

    async def _claim_once(self, session_id: str, *, owner: str, trigger: str, lease_s: float,
                          now: dt.datetime, task_id: str | None, bulk_job_id: str | None
                          ) -> Claim | Busy | Skipped:
        run_id = uuid.uuid4().hex
        if bulk_job_id is None:
            claimed = await self._claim_call(session_id, run_id=run_id, owner=owner,
                                             trigger=trigger, lease_s=lease_s, now=now,
                                             task_id=task_id)
            if claimed is not None:
                return claimed
        async with transaction(self.engine) as conn:
            left = deadline_left_s()
            await self.db.wait_for_row_lock(
                conn, CLAIM_LOCK_WAIT_S if left is None else min(CLAIM_LOCK_WAIT_S, left))
            info = await self._session(conn, session_id, lock=True)
            if bulk_job_id is not None and await self._bulk_item_done(conn, bulk_job_id,
                                                                      session_id):
                # Checked under the row lock that the committing run also takes, so a bulk
                # item delivered twice is compacted once.
                return Skipped(reason=f"bulk job {bulk_job_id} already finished this session")
            if info.lease_live(now):
                await self._insert_run(
                    conn, run_id, session_id, trigger=trigger, owner=owner, fence=None,
                    task_id=task_id, bulk_job_id=bulk_job_id, version=info.surface_version,
                    now=now, status=RunStatus.FAILED, failure_class=FailureClass.BUSY,
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
                "session_id": session_id, "seq": seq, "kind": JournalKind.START, "run_id": run_id,
                "created_at": now, "tokens": None,
                "payload": {"run_id": run_id, "trigger": trigger, "owner": owner,
                            "fence": fence, "surface_version": info.surface_version}})
            row = (await conn.execute(_CLAIM_UPDATE, {
                "b_id": session_id, "b_last_seq": seq, "b_owner": owner, "b_run": run_id,
                "b_expires": expires, "b_fence": fence})).one()
            await self._insert_run(conn, run_id, session_id, trigger=trigger, owner=owner,
                                   fence=fence, task_id=task_id, bulk_job_id=bulk_job_id,
                                   version=info.surface_version, now=now, status=RunStatus.RUNNING)
            info = session_from_row(row)
        return Claim(session=info, run_id=run_id, fence=fence, owner=owner, expires_at=expires)

    async def _claim_call(self, session_id: str, *, run_id: str, owner: str, trigger: str,
                          lease_s: float, now: dt.datetime, task_id: str | None
                          ) -> Claim | None:
        """The claim of a session with no lease, as one call of ``compactd_claim``; None when
        the session is leased or has an expired lease to close, which the general path handles,
        or where the backend has no such function. A bulk item always takes the general path
        (it checks the job)."""
        expires = now + dt.timedelta(seconds=lease_s)
        row = await self.db.claim_call(session_id=session_id, run_id=run_id, owner=owner,
                                       trigger=trigger, expires=expires, now=now,
                                       task_id=task_id)
        if row is None:
            return None
        info = session_from_record(row)
        if info.lease_run_id != run_id:
            return None
        return Claim(session=info, run_id=run_id, fence=info.lease_fence, owner=owner,
                     expires_at=expires)

    async def _insert_run(self, conn: AsyncConnection, run_id: str, session_id: str, *,
                          trigger: str, owner: str, fence: int | None, task_id: str | None,
                          bulk_job_id: str | None, version: int, now: dt.datetime, status: str,
                          failure_class: str | None = None, error: str | None = None) -> None:
        finished = None if status == RunStatus.RUNNING else now
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
            session_id=info.id, seq=seq, kind=JournalKind.END, run_id=run_id, created_at=now,
            payload={"run_id": run_id, "outcome": RunStatus.FAILED,
                     "failure_class": FailureClass.ABANDONED, "closed_by": by,
                     "lease_owner": info.lease_owner,
                     "lease_expired_at": _iso(info.lease_expires_at)}))
        await _abandon_run(conn, run_id, now, error or (
            f"lease of {info.lease_owner} expired at {_iso(info.lease_expires_at)}"))

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
        for rep in replacements:
            if rep.before is not None and rep.after is not None:
                raise ValueError("a replacement is placed before a node or after one, not both")
            if rep.after is not None and rep.seqs:
                raise ValueError("a replacement placed after a node replaces nothing")
            if not rep.seqs and rep.after is None:
                raise ValueError("a replacement must name at least one seq")
        committed = await self._commit_call(session_id, run_id=run_id, fence=fence,
                                            replacements=replacements, wanted=wanted,
                                            expected=expected, end=end, now=now)
        if committed is not None:
            return committed
        async with transaction(self.engine) as conn:
            info = await self._session(conn, session_id, lock=True)
            if info.lease_fence != fence or info.lease_run_id != run_id:
                raise _lease_lost(session_id, run_id, fence, info.lease_fence)
            prefix = None
            if expected:
                # Read one row past the checked prefix: a commit's window ends one past the
                # last position it names.
                upto = max(pos for pos, _ in expected)
                prefix = (await conn.execute(_PREFIX, {"b_session": session_id,
                                                       "b_upto": upto + 1})).all()
                if [(r.position, r.seq) for r in prefix
                        if r.position <= upto] != [tuple(x) for x in expected]:
                    raise _prefix_changed(session_id, run_id)
            window = await self._window(conn, session_id, replacements, prefix,
                                        max(pos for pos, _ in expected) + 1 if expected else 0)
            rows = SurfaceRows(window)
            events: list[dict[str, Any]] = []
            seq = info.last_seq
            for rep, (journal_seq, seq) in zip(
                    replacements, commit_seqs(info.last_seq, len(replacements)), strict=True):
                try:
                    rows.replace(seq, rep.tokens, rep.seqs, before=rep.before, after=rep.after)
                except PlacementError as exc:
                    raise _refused(rep, exc.what) from None
                # Journal entry, then the node, per replacement: the same seqs as one at a time.
                events.append({"session_id": session_id, "seq": journal_seq,
                               "kind": rep.journal_kind, "run_id": run_id, "created_at": now,
                               "tokens": None, "payload": _journal_payload(rep, run_id)})
                events.append({"session_id": session_id, "seq": seq, "kind": rep.kind,
                               "run_id": run_id, "created_at": now, "tokens": rep.tokens,
                               "payload": _node_payload(rep, run_id)})
            before = {(p, q): tokens for p, q, tokens in window}
            after = {(p, q): tokens for p, q, tokens in rows.rows()}
            gone = [q for (p, q) in before if (p, q) not in after]
            nodes = [{"session_id": session_id, "position": p, "seq": q, "tokens": tokens}
                     for (p, q), tokens in after.items() if (p, q) not in before]
            d_tokens = sum(after.values()) - sum(before.values())
            d_nodes = len(after) - len(before)
            if end is not None:
                # compaction/end is the last event, in the same transaction as the checkpoint.
                seq += 1
                events.append(_end_event(session_id, run_id, seq, end, now))
            # A handful of statements however many replacements (a prune commit has one per
            # large tool result): the commit holds the session row, and appends wait on it.
            if events:
                await conn.execute(_INSERT_EVENTS, events)
            if gone:
                await conn.execute(_DELETE_NODES, {"b_session": session_id, "b_seqs": gone})
            if nodes:
                await conn.execute(_INSERT_NODES, nodes)
            row = (await conn.execute(
                _commit_update(bool(replacements), end is not None),
                {"b_id": session_id, "b_last_seq": seq, "b_tokens": d_tokens,
                 "b_nodes": d_nodes})).one()
            if end is not None:
                await self._end_run(conn, session_id, run_id, end, now)
            return session_from_row(row)

    async def _commit_call(self, session_id: str, *, run_id: str, fence: int,
                           replacements: Sequence[Replacement], wanted: list[int],
                           expected: Sequence[tuple[int, int]] | None, end: RunEnd | None,
                           now: dt.datetime) -> SessionInfo | None:
        """The commit as one statement, in autocommit: a call of ``compactd_commit``, and with
        ``end`` the run row's result and its bulk item's in the same statement
        (``commit_ending``). As a transaction around the call that was three more round trips
        (BEGIN, the run row, COMMIT), with appends waiting on the session row meanwhile. None
        where the backend has no such function."""
        placed = any(rep.placed for rep in replacements)
        recalls = [node_recall(rep.payload) for rep in replacements]
        params: dict[str, Any] = {
            "session_id": session_id, "run_id": run_id, "fence": fence, "now": now,
            "seqs": wanted, "counts": [len(rep.seqs) for rep in replacements],
            "kinds": [rep.kind for rep in replacements],
            "payloads": [dumps(_node_payload(rep, run_id)) for rep in replacements],
            "tokens": [rep.tokens for rep in replacements],
            "journal_kinds": [rep.journal_kind for rep in replacements],
            "journals": [dumps(_journal_payload(rep, run_id)) for rep in replacements],
            "expected_pos": [pos for pos, _ in expected] if expected else None,
            "expected_seq": [seq for _, seq in expected] if expected else None,
            "end_payload": dumps(_end_payload(run_id, end)) if end is not None else None,
            # NULL unless a replacement is placed: compactd_commit then writes in one batch.
            "before": [rep.before for rep in replacements] if placed else None,
            "after": [rep.after for rep in replacements] if placed else None,
            # What each node states about itself for recall, read here: the payload may hold
            # what no JSON operator of PostgreSQL reads (a NUL).
            "refs": [r.ref for r in recalls], "firsts": [r.first for r in recalls],
            "lasts": [r.last for r in recalls]}

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
                return _refused(replacements[int(index) - 1], what)
            return None

        name = "commit"
        if end is not None:
            name = "commit_ending"
            params.update({column: _json_or_none(value) if column in _RUN_JSON_COLUMNS else value
                           for column, value in _run_end_values(end).items()},
                          item_state=bulk_item_state(end.outcome), item_done=ItemState.DONE)
        try:
            record = await self.db.commit_call(name, **params)
        except Exception as exc:
            mapped = failed(exc)
            if mapped is None:
                raise  # translated like every driver error (lock timeout, lost connection)
            raise mapped from None
        return None if record is None else session_from_record(record)

    async def _window(self, conn: AsyncConnection, session_id: str,
                      replacements: Sequence[Replacement], prefix: Sequence[Any] | None,
                      read_to: int) -> list[tuple[int, int, int]]:
        """The surface rows a commit reads and writes: from the first position it names to one
        past the last (:class:`SurfaceRows`); from ``prefix`` (every row through position
        ``read_to``) when it holds them."""
        named = {q for rep in replacements for q in rep.seqs}
        named.update(q for rep in replacements for q in (rep.before, rep.after) if q is not None)
        if not named:
            return []
        if prefix is not None:
            position = {r.seq: r.position for r in prefix}
            if named <= position.keys() and max(position[q] for q in named) < read_to:
                lo, hi = min(position[q] for q in named), max(position[q] for q in named) + 1
                return [(r.position, r.seq, r.tokens) for r in prefix if lo <= r.position <= hi]
        found = [r.position for r in await conn.execute(
            _ROWS_BY_SEQ, {"b_session": session_id, "b_seqs": sorted(named)})]
        if not found:
            return []
        return [(r.position, r.seq, r.tokens) for r in await conn.execute(
            _WINDOW, {"b_session": session_id, "b_first": min(found),
                      "b_last": max(found) + 1})]

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
            await _abandon_run(conn, run_id, now, "lease lost before the run ended "
                               f"({end.failure_class or end.outcome})")
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
        await self._close_abandoned(conn, info, seq=info.last_seq + 1, now=now, by=by,
                                    error=error)
        await conn.execute(t.sessions.update().where(t.sessions.c.id == info.id).values(
            last_seq=info.last_seq + 1, lease_owner=None, lease_run_id=None,
            lease_expires_at=None))
        return ReapedLease(session_id=info.id, run_id=info.lease_run_id, owner=info.lease_owner,
                           expired_at=info.lease_expires_at)


# The statements of the compaction hot path, built once: constructing a statement costs about as
# much CPU as executing it, and a worker runs dozens of compactions a second.
_s, _c, _r = t.surface.c, t.sessions.c, t.compaction_runs.c
# The run row's result, column by column, as every way of ending a run writes it.
_RUN_END_COLUMNS = ("status", "failure_class", "error", "tokens_before", "tokens_after", "model",
                    "usage", "candidates", "stages", "range_seqs", "signalled_at")
_RUN_JSON_COLUMNS = frozenset(c for c in _RUN_END_COLUMNS
                              if isinstance(t.compaction_runs.c[c].type, sa.JSON))


def _run_end_values(end: RunEnd) -> dict[str, Any]:
    values = {"status": end.outcome, "failure_class": end.failure_class, "error": end.error,
              "tokens_before": end.tokens_before, "tokens_after": end.tokens_after,
              "model": end.model, "usage": end.usage, "candidates": end.candidates,
              "stages": end.stages, "range_seqs": end.range_seqs,
              "signalled_at": end.signalled_at}
    return {column: values[column] for column in _RUN_END_COLUMNS}


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
_WINDOW = (sa.select(_s.position, _s.seq, _s.tokens)
           .where(_s.session_id == sa.bindparam("b_session"),
                  _s.position >= sa.bindparam("b_first"),
                  _s.position <= sa.bindparam("b_last"))
           .order_by(_s.position))
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


@functools.cache
def _commit_update(replaced: bool, ended: bool) -> Any:
    """The session update of a commit: always the new last seq; with replacements the surface
    totals and version; with an end the lease cleared."""
    values: dict[str, Any] = {"last_seq": sa.bindparam("b_last_seq")}
    if replaced:
        values.update(surface_version=_c.surface_version + 1,
                      surface_tokens=_c.surface_tokens + sa.bindparam("b_tokens"),
                      surface_messages=_c.surface_messages + sa.bindparam("b_nodes"),
                      reported_input_tokens=None, reported_version=None,
                      compacted_version=_c.surface_version + 1,
                      compacted_tokens=(_c.surface_tokens + sa.bindparam("b_tokens")
                                        + _c.envelope_tokens))
    if ended:
        values.update(lease_owner=None, lease_run_id=None, lease_expires_at=None)
    return (t.sessions.update().where(_c.id == sa.bindparam("b_id")).values(**values)
            .returning(*SESSION_COLUMNS))


def _end_event(session_id: str, run_id: str, seq: int, end: RunEnd, now: dt.datetime
               ) -> dict[str, Any]:
    return {"session_id": session_id, "seq": seq, "kind": JournalKind.END, "run_id": run_id,
            "created_at": now, "tokens": None, "payload": _end_payload(run_id, end)}


def _end_payload(run_id: str, end: RunEnd) -> dict[str, Any]:
    return {"run_id": run_id, "outcome": end.outcome, "failure_class": end.failure_class,
            "tokens_before": end.tokens_before, "tokens_after": end.tokens_after}


def _journal_payload(rep: Replacement, run_id: str) -> dict[str, Any]:
    return {"run_id": run_id, **rep.journal, "replaced_seqs": list(rep.seqs),
            **_placement(rep)}


def _node_payload(rep: Replacement, run_id: str) -> dict[str, Any]:
    return {"message": rep.payload, "replaces": list(rep.seqs), "run_id": run_id,
            **_placement(rep)}


def _placement(rep: Replacement) -> dict[str, int]:
    """Where a placed node went, beside what it replaced: replay needs it."""
    if rep.before is not None:
        return {"before": rep.before}
    if rep.after is not None:
        return {"after": rep.after}
    return {}


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


def _refused(rep: Replacement, what: str) -> SurfaceChanged:
    """Why a replacement does not fit the surface, in the words of both backends (``what`` is
    :attr:`PlacementError.what`, or the word in compactd_commit's CD410 detail)."""
    if what == "before":
        return SurfaceChanged(f"seq {rep.before} no longer directly precedes seqs "
                              f"{list(rep.seqs)}")
    if what == "after":
        return SurfaceChanged(f"there is no free position directly after seq {rep.after}")
    return _run_changed(rep.seqs, contiguous=what == "contiguous")


async def _abandon_run(conn: AsyncConnection, run_id: str | None, now: dt.datetime, error: str
                       ) -> None:
    """End run ``run_id`` as abandoned, if it is still running (a lease written before leases
    named their run has none to end)."""
    if run_id is None:
        return
    await conn.execute(
        t.compaction_runs.update()
        .where(t.compaction_runs.c.id == run_id,
               t.compaction_runs.c.status == RunStatus.RUNNING)
        .values(status=RunStatus.FAILED, failure_class=FailureClass.ABANDONED,
                finished_at=now, error=error))


def _iso(value: dt.datetime | None) -> str | None:
    return value.isoformat() if value else None
