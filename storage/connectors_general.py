"""The append, the claim and the commit as general statements in one SQLAlchemy transaction.

This is the whole of SQLite's append, claim and commit, and PostgreSQL's claim of what
``compactd_claim`` leaves to it (a leased session, an expired lease to close, a bulk item). The
statements are the same on both backends; which backend runs what is the connectors' choice
(:mod:`storage.connectors`), and nothing here asks which backend it is on. The rows a commit
journals, and the errors a refused commit raises, are built here for both connectors, so that
both store and say the same thing.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import functools
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from compactd.storage import schema as t
from compactd.storage.bulk_jobs import bulk_item_state
from compactd.storage.counters import node_counts, reaches, summed
from compactd.storage.errors import (
    IdempotencyKeyReused,
    LeaseLost,
    LockNotAvailable,
    SessionNotFound,
    StorageError,
    SurfaceChanged,
)
from compactd.storage.kinds import (
    REPLACE_KINDS,
    FailureClass,
    ItemState,
    JournalKind,
    NodeKind,
    RunStatus,
)
from compactd.storage.leads import pool_lead
from compactd.storage.messages import BatchLinks, Message, ToolLinks, referenced_call_ids
from compactd.storage.records import (
    STEP_DECAY,
    AppendKey,
    AppendResult,
    Busy,
    Claim,
    Replacement,
    RunEnd,
    SessionInfo,
    Skipped,
    growth_rate_after,
)
from compactd.storage.schema import SESSION_COLUMNS, session_from_record, session_from_row
from compactd.storage.surface import PlacementError, SurfaceRows, commit_seqs

if TYPE_CHECKING:
    from compactd.storage.store import PreparedAppend

# How long a targeted claim waits for the session row another transaction holds (an append, a
# usage report, another claim, a commit: each for milliseconds), in the row's lock queue; the
# run's deadline ends the wait sooner. compactd_claim has the same wait (its SET lock_timeout,
# storage/sql/functions/compactd_claim.sql).
CLAIM_LOCK_WAIT_S = 5.0


# ---------------------------------------------------------------------------------------------
# the session row


@functools.cache
def session_select(lock: bool, nowait: bool) -> Any:
    # Built once per flag combination: constructing a 24-column statement on every call costs
    # more than SQLAlchemy's cached compilation saves.
    stmt = sa.select(*SESSION_COLUMNS).where(_c.id == sa.bindparam("b_id"))
    if lock:
        stmt = stmt.with_for_update(nowait=nowait)
    return stmt


async def read_session(conn: AsyncConnection, session_id: str, *, lock: bool = False,
                       nowait: bool = False) -> SessionInfo:
    row = (await conn.execute(session_select(lock, nowait), {"b_id": session_id})).first()
    if row is None:
        raise SessionNotFound(session_id)
    return session_from_row(row)


# ---------------------------------------------------------------------------------------------
# append


async def append_in(conn: AsyncConnection, session_id: str, batch: PreparedAppend,
                    now: dt.datetime, *, signal_if: Callable[[SessionInfo], bool] | None,
                    signal_ttl_s: float, mark_signal: Callable[..., Any]) -> AppendResult:
    """The append of separate statements: the session's totals, the tool links, the events and
    the surface rows, and the pending-signal mark when ``signal_if`` holds on the new totals
    (``mark_signal``: the connector's ``mark_signal`` statement inside ``conn``)."""
    stored, payloads, tokens = batch.messages, batch.payloads, batch.tokens
    assert stored is not None and payloads is not None
    n, total = len(tokens), sum(tokens)
    linked = list(referenced_call_ids(stored))
    c = t.sessions.c
    row = (await conn.execute(
        t.sessions.update().where(c.id == session_id)
        .values(last_seq=c.last_seq + n, last_position=c.last_position + n,
                surface_version=c.surface_version + 1,
                surface_tokens=c.surface_tokens + total,
                surface_messages=c.surface_messages + n, last_append_at=now,
                growth_rate=_next_growth_rate(total, now),
                step_tokens=_next_step_tokens(total), lead_s=pool_lead())
        .returning(*SESSION_COLUMNS))).first()
    if row is None:
        raise SessionNotFound(session_id)
    info = session_from_row(row)
    if batch.counts_sum is not None:
        info = await _add_counts(conn, info, batch.counts_sum)
    first_seq = info.last_seq - n + 1
    first_position = info.last_position - n + 1
    if linked:
        await _link_tool_calls(conn, session_id, stored, linked, first_seq)
    await conn.execute(t.events.insert(), [
        {"session_id": session_id, "seq": first_seq + i, "kind": NodeKind.MESSAGE,
         "payload": payloads[i], "tokens": tokens[i], "created_at": now}
        for i in range(n)])
    counts = batch.counts or [None] * n
    await conn.execute(t.surface.insert(), [
        {"session_id": session_id, "position": first_position + i,
         "seq": first_seq + i, "tokens": tokens[i], "counts": counts[i]} for i in range(n)])
    signalled = False
    if signal_if is not None and signal_if(info):
        signalled = bool(await mark_signal(
            conn=conn, session_id=session_id, now=now,
            stale_before=now - dt.timedelta(seconds=signal_ttl_s)))
    return AppendResult(session=info, first_seq=first_seq, last_seq=info.last_seq,
                        tokens=tokens, signalled=signalled)


class KeyTaken(Exception):
    """Another append with the key committed first: this one is rolled back and answered
    from that append's row (raised and caught inside the connector)."""


def key_params(session_id: str, key: AppendKey, result: AppendResult,
               now: dt.datetime) -> dict[str, Any]:
    """The parameters of ``append_key_store``: what ``result`` says, under ``key``."""
    info = result.session
    return {"session_id": session_id, "key": key.key, "request_sha256": key.request_sha256,
            "first_seq": result.first_seq, "last_seq": result.last_seq,
            "surface_version": info.surface_version, "surface_tokens": info.surface_tokens,
            "surface_messages": info.surface_messages, "now": now,
            "live_after": key.live_after}


def replayed(found: Any, key: AppendKey, tokens: tuple[int, ...]) -> AppendResult:
    """The answer to an append made again with ``key``, from ``append_key_find``'s row: the
    seqs, version and totals the first append returned (the session's other fields as they
    are now). Refused when the key came with another batch."""
    if found["key_request_sha256"] != key.request_sha256:
        raise IdempotencyKeyReused(key.key)
    info = dataclasses.replace(
        session_from_record(found), surface_version=found["key_surface_version"],
        surface_tokens=found["key_surface_tokens"],
        surface_messages=found["key_surface_messages"])
    return AppendResult(session=info, first_seq=found["key_first_seq"],
                        last_seq=found["key_last_seq"], tokens=tokens, replayed=True)


async def first_with_key(attempt: Callable[[], Awaitable[AppendResult | None]]
                         ) -> AppendResult:
    """Run a keyed append's ``attempt`` (None: :class:`KeyTaken`, rolled back); a second
    attempt then finds the row of the append that took the key."""
    for _ in range(2):
        result = await attempt()
        if result is not None:
            return result
    raise StorageError("an append key was taken and then not found")


async def _add_counts(conn: AsyncConnection, info: SessionInfo, added: Any) -> SessionInfo:
    """The session's counts kept by name with ``added`` on top, and whether they reach their
    floors (``compactd_append_v5`` does the same in its one statement)."""
    counts = summed([info.counts, added])
    over = reaches(counts, info.sweep_counts)
    await conn.execute(t.sessions.update().where(t.sessions.c.id == info.id)
                       .values(counts=counts, over_counts=over))
    return dataclasses.replace(info, counts=counts, over_counts=over)


async def _link_tool_calls(conn: AsyncConnection, session_id: str, messages: Sequence[Message],
                           linked: list[str], first_seq: int) -> None:
    tc = t.tool_calls.c
    rows = (await conn.execute(
        sa.select(tc.call_id, tc.result_seq)
        .where(tc.session_id == session_id, tc.call_id.in_(sorted(set(linked)))))).all()
    ToolLinks(open_ids=[r.call_id for r in rows if r.result_seq is None],
              closed_ids=[r.call_id for r in rows]).check(messages)
    links = BatchLinks(messages)
    # Close the calls answered from before the batch first: the batch may issue their ids
    # again (see ToolLinks).
    if links.external:
        await conn.execute(
            t.tool_calls.update()
            .where(tc.session_id == session_id, tc.call_id == sa.bindparam("b_call"),
                   tc.result_seq.is_(None))
            .values(result_seq=sa.bindparam("b_seq")),
            [{"b_call": cid, "b_seq": first_seq + idx} for cid, idx in links.external])
    if links.calls:
        await conn.execute(t.tool_calls.insert(), [
            {"session_id": session_id, "call_id": cid, "call_seq": first_seq + idx,
             "result_seq": None if ridx is None else first_seq + ridx}
            for cid, idx, ridx in links.calls])


def _next_growth_rate(added: int, now: dt.datetime) -> sa.ColumnElement[float]:
    """``records.next_growth_rate`` on the row being updated, for the append of separate
    statements (SQLite's: PostgreSQL's is in ``compactd_append``). SQLite stores naive UTC text,
    which julianday reads; columns on the right of SET are the row before the update."""
    c = t.sessions.c
    since = (sa.func.julianday(sa.literal(now, t.UTCDateTime))
             - sa.func.julianday(sa.func.coalesce(c.last_append_at, c.created_at))) * 86400.0
    return sa.type_coerce(growth_rate_after(c.growth_rate, added, sa.func.max(0.0, since)),
                          sa.Float)


def _next_step_tokens(added: int) -> sa.ColumnElement[float]:
    """``records.step_tokens_after`` on the row being updated (SQLite's append; PostgreSQL's
    is in ``compactd_append_v5``): the session's first append has no earlier one."""
    c = t.sessions.c
    return sa.type_coerce(
        sa.case((c.last_append_at.is_(None), 0.0),
                else_=sa.func.max(c.step_tokens * STEP_DECAY, float(added))), sa.Float)


# ---------------------------------------------------------------------------------------------
# claim


async def claim_in(conn: AsyncConnection, session_id: str, *, run_id: str, owner: str,
                   trigger: str, lease_s: float, now: dt.datetime, task_id: str | None,
                   bulk_job_id: str | None) -> Claim | Busy | Skipped:
    """The claim under the session row's lock: a busy attempt when another run's lease is
    live, a skip when the bulk item is done, else the lease (closing an expired one first)."""
    info = await read_session(conn, session_id, lock=True)
    if bulk_job_id is not None and await _bulk_item_done(conn, bulk_job_id, session_id):
        # Checked under the row lock that the committing run also takes, so a bulk
        # item delivered twice is compacted once.
        return Skipped(reason=f"bulk job {bulk_job_id} already finished this session")
    if info.lease_live(now):
        await insert_run(
            conn, run_id, session_id, trigger=trigger, owner=owner, fence=None,
            task_id=task_id, bulk_job_id=bulk_job_id, version=info.surface_version,
            now=now, status=RunStatus.FAILED, failure_class=FailureClass.BUSY,
            error=f"leased by {info.lease_owner} until {info.lease_expires_at}")
        return Busy(run_id=run_id, holder=info.lease_owner, expires_at=info.lease_expires_at)
    seq = info.last_seq
    if info.lease_run_id is not None:
        # An expired lease the reaper has not reached yet: close it the same way.
        seq += 1
        await close_abandoned(conn, info, seq=seq, now=now, by=owner)
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
    await insert_run(conn, run_id, session_id, trigger=trigger, owner=owner,
                     fence=fence, task_id=task_id, bulk_job_id=bulk_job_id,
                     version=info.surface_version, now=now, status=RunStatus.RUNNING)
    return Claim(session=session_from_row(row), run_id=run_id, fence=fence, owner=owner,
                 expires_at=expires)


async def insert_run(conn: AsyncConnection, run_id: str, session_id: str, *, trigger: str,
                     owner: str, fence: int | None, task_id: str | None,
                     bulk_job_id: str | None, version: int, now: dt.datetime, status: str,
                     failure_class: str | None = None, error: str | None = None) -> None:
    finished = None if status == RunStatus.RUNNING else now
    await conn.execute(_INSERT_RUN, {
        "id": run_id, "session_id": session_id, "trigger": trigger, "status": status,
        "failure_class": failure_class, "owner": owner, "fence": fence, "task_id": task_id,
        "bulk_job_id": bulk_job_id, "surface_version_at_start": version, "error": error,
        "started_at": now, "heartbeat_at": now, "finished_at": finished})


async def close_abandoned(conn: AsyncConnection, info: SessionInfo, *, seq: int,
                          now: dt.datetime, by: str, error: str | None = None) -> None:
    """Journal the end of an expired lease's run and mark the run abandoned."""
    run_id = info.lease_run_id
    await conn.execute(t.events.insert().values(
        session_id=info.id, seq=seq, kind=JournalKind.END, run_id=run_id, created_at=now,
        payload={"run_id": run_id, "outcome": RunStatus.FAILED,
                 "failure_class": FailureClass.ABANDONED, "closed_by": by,
                 "lease_owner": info.lease_owner,
                 "lease_expired_at": _iso(info.lease_expires_at)}))
    await abandon_run(conn, run_id, now, error or (
        f"lease of {info.lease_owner} expired at {_iso(info.lease_expires_at)}"))


async def abandon_run(conn: AsyncConnection, run_id: str | None, now: dt.datetime, error: str
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


async def _bulk_item_done(conn: AsyncConnection, job_id: str, session_id: str) -> bool:
    i = t.bulk_items.c
    state = (await conn.execute(sa.select(i.state).where(
        i.job_id == job_id, i.session_id == session_id))).scalar()
    return state == ItemState.DONE


def row_stayed_locked(session_id: str) -> LockNotAvailable:
    return LockNotAvailable(f"the row of session {session_id!r} stayed locked by another "
                            f"transaction for {CLAIM_LOCK_WAIT_S:g} s")


# ---------------------------------------------------------------------------------------------
# commit


async def commit_in(conn: AsyncConnection, session_id: str, *, run_id: str, fence: int,
                    replacements: Sequence[Replacement],
                    expected: Sequence[tuple[int, int]] | None, end: RunEnd | None,
                    now: dt.datetime) -> SessionInfo:
    """The commit under the session row's lock: the fence, the prefix the plan read, the
    replacements placed on the window they touch, then the rows written in a handful of
    statements, and with ``end`` the run ended in the same transaction."""
    info = await read_session(conn, session_id, lock=True)
    if info.lease_fence != fence or info.lease_run_id != run_id:
        raise lease_lost(session_id, run_id, fence, info.lease_fence)
    prefix = await _checked_prefix(conn, session_id, run_id, expected)
    window = await _window(conn, session_id, replacements, prefix,
                           max(pos for pos, _ in expected) + 1 if expected else 0)
    events, placed, seq = _placed(session_id, run_id, replacements, window, info.last_seq, now)
    if end is not None:
        # compaction/end is the last event, in the same transaction as the checkpoint.
        seq += 1
        events.append(end_event(session_id, run_id, seq, end, now))
    added = {node["seq"]: counts for node in events
             if node["kind"] in REPLACE_KINDS and (counts := node_counts(
                 node["payload"]["message"], node["tokens"])) is not None}
    row = await _write_commit(conn, session_id, events, window, placed, added,
                              update=_commit_update(bool(replacements), end is not None),
                              last_seq=seq)
    after = session_from_row(row)
    if replacements and (after.counts is not None or added):
        after = await _recount(conn, after)
    if end is not None:
        await end_run(conn, session_id, run_id, end, now)
    return after


async def _recount(conn: AsyncConnection, info: SessionInfo) -> SessionInfo:
    """The session's counts kept by name summed again from its surface rows, which a commit
    replaced some of (``compactd_commit_v4`` does the same)."""
    rows = (await conn.execute(
        sa.select(_s.counts).where(_s.session_id == info.id, _s.counts.is_not(None)))).all()
    counts = summed(r.counts for r in rows)
    over = reaches(counts, info.sweep_counts)
    await conn.execute(t.sessions.update().where(_c.id == info.id)
                       .values(counts=counts, over_counts=over))
    return dataclasses.replace(info, counts=counts, over_counts=over)


async def _checked_prefix(conn: AsyncConnection, session_id: str, run_id: str,
                          expected: Sequence[tuple[int, int]] | None) -> Sequence[Any] | None:
    """The surface rows through the last position the plan read (and one more), once they
    are checked to be the ones it read; None when the plan names no prefix."""
    if not expected:
        return None
    # Read one row past the checked prefix: a commit's window ends one past the
    # last position it names.
    upto = max(pos for pos, _ in expected)
    prefix = (await conn.execute(_PREFIX, {"b_session": session_id, "b_upto": upto + 1})).all()
    if [(r.position, r.seq) for r in prefix
            if r.position <= upto] != [tuple(x) for x in expected]:
        raise prefix_changed(session_id, run_id)
    return prefix


def _placed(session_id: str, run_id: str, replacements: Sequence[Replacement],
            window: list[tuple[int, int, int]], last_seq: int, now: dt.datetime
            ) -> tuple[list[dict[str, Any]], SurfaceRows, int]:
    """Each replacement placed on the window, with its journal entry and node: (the events,
    the window's rows after, the last seq written)."""
    rows = SurfaceRows(window)
    events: list[dict[str, Any]] = []
    seq = last_seq
    for rep, (journal_seq, seq) in zip(
            replacements, commit_seqs(last_seq, len(replacements)), strict=True):
        try:
            rows.replace(seq, rep.tokens, rep.seqs, before=rep.before, after=rep.after,
                         keeps=rep.keeps)
        except PlacementError as exc:
            raise refused(rep, exc.what) from None
        # Journal entry, then the node, per replacement: the same seqs as one at a time.
        events.append({"session_id": session_id, "seq": journal_seq,
                       "kind": rep.journal_kind, "run_id": run_id, "created_at": now,
                       "tokens": None, "payload": journal_payload(rep, run_id)})
        events.append({"session_id": session_id, "seq": seq, "kind": rep.kind,
                       "run_id": run_id, "created_at": now, "tokens": rep.tokens,
                       "payload": node_payload(rep, run_id)})
    return events, rows, seq


async def _write_commit(conn: AsyncConnection, session_id: str, events: list[dict[str, Any]],
                        window: list[tuple[int, int, int]], placed: SurfaceRows,
                        counts: dict[int, Any], *, update: Any, last_seq: int) -> Any:
    """The commit's writes: the events, the window's rows that went and came, the session's
    totals. A handful of statements however many replacements (a prune commit has one per
    large tool result): the commit holds the session row, and appends wait on it."""
    before = {(p, q): tokens for p, q, tokens in window}
    after = {(p, q): tokens for p, q, tokens in placed.rows()}
    gone = [q for (p, q) in before if (p, q) not in after]
    moved = {q for p, q, _ in window} & {q for (p, q) in after if (p, q) not in before}
    if moved:
        # A node placed before another moves that one: it is written again with its counts.
        counts = {**counts, **{r.seq: r.counts for r in await conn.execute(
            sa.select(_s.seq, _s.counts).where(_s.session_id == session_id,
                                               _s.seq.in_(sorted(moved))))}}
    nodes = [{"session_id": session_id, "position": p, "seq": q, "tokens": tokens,
              "counts": counts.get(q)}
             for (p, q), tokens in after.items() if (p, q) not in before]
    if events:
        await conn.execute(_INSERT_EVENTS, events)
    if gone:
        await conn.execute(_DELETE_NODES, {"b_session": session_id, "b_seqs": gone})
    if nodes:
        await conn.execute(_INSERT_NODES, nodes)
    return (await conn.execute(update, {
        "b_id": session_id, "b_last_seq": last_seq,
        "b_tokens": sum(after.values()) - sum(before.values()),
        "b_nodes": len(after) - len(before)})).one()


async def _window(conn: AsyncConnection, session_id: str, replacements: Sequence[Replacement],
                  prefix: Sequence[Any] | None, read_to: int) -> list[tuple[int, int, int]]:
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


async def write_end(conn: AsyncConnection, session_id: str, run_id: str, seq: int, end: RunEnd,
                    now: dt.datetime) -> None:
    """A run ended without a commit: its journal end, the lease cleared, the run's result."""
    await conn.execute(_INSERT_EVENTS, end_event(session_id, run_id, seq, end, now))
    await conn.execute(_END_LEASE, {"b_id": session_id, "b_last_seq": seq})
    if end.refire is not None:
        await conn.execute(_REFIRE, {"b_id": session_id, "b_tokens": end.refire[0],
                                     "b_version": end.refire[1]})
    await end_run(conn, session_id, run_id, end, now)


async def end_run(conn: AsyncConnection, session_id: str, run_id: str, end: RunEnd,
                  now: dt.datetime) -> None:
    """The run row's result, and its bulk item's when it belongs to a bulk job."""
    job_id = (await conn.execute(_END_RUN, {
        "b_id": run_id, "b_now": now,
        **{f"b_{column}": value for column, value in run_end_values(end).items()}})).scalar()
    if job_id is not None:
        await settle_bulk_item(conn, run_id, session_id, end.outcome, now)


async def settle_bulk_item(conn: AsyncConnection, run_id: str, session_id: str, outcome: str,
                           now: dt.datetime) -> None:
    """Record a bulk run's result on its item, in the transaction that ends the run."""
    job_id = (await conn.execute(sa.select(t.compaction_runs.c.bulk_job_id).where(
        t.compaction_runs.c.id == run_id))).scalar()
    if job_id is None:
        return
    i = t.bulk_items.c
    await conn.execute(
        t.bulk_items.update()
        .where(i.job_id == job_id, i.session_id == session_id, i.state != ItemState.DONE)
        .values(state=bulk_item_state(outcome), run_id=run_id, updated_at=now))


# ---------------------------------------------------------------------------------------------
# the rows a commit journals, on both backends

# The run row's result, column by column, as every way of ending a run writes it.
RUN_END_COLUMNS = ("status", "failure_class", "error", "tokens_before", "tokens_after", "model",
                   "usage", "candidates", "stages", "range_seqs", "signalled_at")
RUN_JSON_COLUMNS = frozenset(c for c in RUN_END_COLUMNS
                             if isinstance(t.compaction_runs.c[c].type, sa.JSON))


def run_end_values(end: RunEnd) -> dict[str, Any]:
    values = {"status": end.outcome, "failure_class": end.failure_class, "error": end.error,
              "tokens_before": end.tokens_before, "tokens_after": end.tokens_after,
              "model": end.model, "usage": end.usage, "candidates": end.candidates,
              "stages": end.stages, "range_seqs": end.range_seqs,
              "signalled_at": end.signalled_at}
    return {column: values[column] for column in RUN_END_COLUMNS}


def end_event(session_id: str, run_id: str, seq: int, end: RunEnd, now: dt.datetime
              ) -> dict[str, Any]:
    return {"session_id": session_id, "seq": seq, "kind": JournalKind.END, "run_id": run_id,
            "created_at": now, "tokens": None, "payload": end_payload(run_id, end)}


def end_payload(run_id: str, end: RunEnd) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "run_id": run_id, "outcome": end.outcome, "failure_class": end.failure_class,
        "tokens_before": end.tokens_before, "tokens_after": end.tokens_after}
    if end.instructions:
        # The journal says what the run was asked to focus on, beside how it ended.
        payload["instructions"] = list(end.instructions)
    if end.hook:
        payload["hook"] = end.hook
    return payload


def journal_payload(rep: Replacement, run_id: str) -> dict[str, Any]:
    return {"run_id": run_id, **rep.journal, "replaced_seqs": list(rep.seqs),
            **_placement(rep)}


def node_payload(rep: Replacement, run_id: str) -> dict[str, Any]:
    return {"message": rep.payload, "replaces": list(rep.seqs), "run_id": run_id,
            **_placement(rep)}


def _placement(rep: Replacement) -> dict[str, Any]:
    """Where a placed node went, beside what it replaced: replay needs it."""
    if rep.keeps:
        return {"keeps": list(rep.keeps)}
    if rep.before is not None:
        return {"before": rep.before}
    if rep.after is not None:
        return {"after": rep.after}
    return {}


def lease_lost(session_id: str, run_id: str, fence: int, current: object) -> LeaseLost:
    return LeaseLost(f"run {run_id} lost its lease on {session_id!r} "
                     f"(fence {fence}, now {current})")


def prefix_changed(session_id: str, run_id: str) -> SurfaceChanged:
    return SurfaceChanged(f"the surface of {session_id!r} changed under run {run_id}")


def _run_changed(seqs: Sequence[int], *, contiguous: bool) -> SurfaceChanged:
    if contiguous:
        return SurfaceChanged(f"seqs {list(seqs)} are no longer one contiguous run of the surface")
    return SurfaceChanged(f"seqs {list(seqs)} are no longer on the surface in that order")


def refused(rep: Replacement, what: str) -> SurfaceChanged:
    """Why a replacement does not fit the surface, in the words of both backends (``what`` is
    :attr:`PlacementError.what`, or the word in compactd_commit's CD410 detail)."""
    if what == "before":
        return SurfaceChanged(f"seq {rep.before} no longer directly precedes seqs "
                              f"{list(rep.seqs)}")
    if what == "after":
        return SurfaceChanged(f"there is no free position directly after seq {rep.after}")
    return _run_changed(rep.seqs, contiguous=what == "contiguous")


def _iso(value: dt.datetime | None) -> str | None:
    return value.isoformat() if value else None


# The statements of the compaction hot path, built once: constructing a statement costs about as
# much CPU as executing it, and a worker runs dozens of compactions a second.
_s, _c, _r = t.surface.c, t.sessions.c, t.compaction_runs.c
_INSERT_EVENTS = t.events.insert()
_INSERT_RUN = t.compaction_runs.insert()
_END_LEASE = (t.sessions.update().where(_c.id == sa.bindparam("b_id"))
              .values(last_seq=sa.bindparam("b_last_seq"), lease_owner=None, lease_run_id=None,
                      lease_expires_at=None))
_REFIRE = (t.sessions.update().where(_c.id == sa.bindparam("b_id"))
           .values(refire_tokens=sa.bindparam("b_tokens"),
                   refire_version=sa.bindparam("b_version")))
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
            .values(**{c: sa.bindparam(f"b_{c}", type_=_r[c].type) for c in RUN_END_COLUMNS},
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
