"""The two backends behind one interface: where PostgreSQL and SQLite differ, and nowhere else.

A connector runs the named queries of ``storage/sql`` and implements the operations the two
backends run differently, each whole: the append, the claim, the commit, the writing of recall's
index and the forms of its searches. :class:`PostgresConnector` runs the named queries on
asyncpg connections of the engine's pool (autocommit, one statement each, on a
:class:`KeptConnections` connection when one is free) and does the append, the free claim and
the commit in one call of compactd's SQL functions. :class:`SQLiteConnector` runs the portable
queries through SQLAlchemy on the embedded file, and does the append, the claim and the commit
with the general statements of :mod:`storage.connectors_general` in one transaction (which
PostgreSQL also runs for the claims its function leaves). Callers do not ask which backend
they are on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import functools
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from compactd.storage import schema as t
from compactd.storage import sql
from compactd.storage.bulk_jobs import bulk_item_state
from compactd.storage.connectors_errors import driver_error
from compactd.storage.connectors_general import (
    CLAIM_LOCK_WAIT_S,
    RUN_JSON_COLUMNS,
    KeyTaken,
    append_in,
    claim_in,
    commit_in,
    end_payload,
    first_with_key,
    journal_payload,
    key_params,
    lease_lost,
    node_payload,
    prefix_changed,
    refused,
    replayed,
    row_stayed_locked,
    run_end_values,
)
from compactd.storage.connectors_kept import KeptConnections
from compactd.storage.counters import node_counts
from compactd.storage.database import (
    connection,
    deadline_left_s,
    transaction,
    translate,
)
from compactd.storage.errors import CompactdError, InvalidMessage, LockNotAvailable, SessionNotFound
from compactd.storage.events import (
    Event,
    Listener,
    VersionPoller,
    VersionWaiter,
    commit_event_fields,
)
from compactd.storage.kinds import ItemState, RunStatus
from compactd.storage.messages import ANSWERED, ORPHAN, REUSED_OPEN
from compactd.storage.recall_index import RecallBody, node_recall
from compactd.storage.records import (
    AppendKey,
    AppendResult,
    Busy,
    Claim,
    Replacement,
    RunEnd,
    SessionInfo,
    Skipped,
)
from compactd.storage.schema import dumps, session_from_record

if TYPE_CHECKING:
    from compactd.storage.messages import Message
    from compactd.storage.store import PreparedAppend

Row = Mapping[Any, Any]

# SQLite has one writer, and a writer queued on the busy timeout sleeps between its tries, each
# sleep about as long as it has waited so far. A deletion that begins its next batch as soon as
# it commits takes the lock again while the queued writer sleeps, and an append then waits out
# the whole deletion. So on SQLite each batch is sized to a short time and followed by a pause as
# long as the batch took: a writer queued during the batch wakes inside the pause and goes first.
SQLITE_DELETE_BATCH_S = 0.01
SQLITE_DELETE_REST_S = 0.005


@dataclass(frozen=True, slots=True)
class DeletionPace:
    """How a deletion spaces the short transactions it deletes in (``storage.deletion``)."""

    #: The time one batch should take: its row count is fitted to it table by table, up to the
    #: deletion's row count (None: every batch has that row count).
    batch_s: float | None = None
    #: The pause after each batch, in which the writers queued behind it take the database:
    #: ``rest_ratio`` times as long as the batch took, and at least ``rest_s``.
    rest_s: float = 0.0
    rest_ratio: float = 0.0

    def rest_after(self, took_s: float) -> float:
        return max(self.rest_s, self.rest_ratio * took_s)


class Connector:
    """The named queries of ``storage/sql``, and the operations one backend runs in one call.

    ``conn``: run inside that SQLAlchemy transaction instead of on a connection of its own.
    """

    engine: AsyncEngine
    #: The append sends the batch as JSON text (:func:`storage.store.prepare_append`). Read
    #: only here: callers ask :attr:`prepare_append`, :meth:`prepared_here` and
    #: :meth:`append_processes`.
    encodes_appends: bool
    #: The suffix of this backend's form of a query the two spell differently.
    variant_suffix: str
    #: How a session's deletion spaces its batches (PostgreSQL locks rows, not the database:
    #: batches of the deletion's row count, back to back, stall no other session there).
    deletion_pace = DeletionPace()

    def _variant(self, name: str) -> str:
        """This backend's form of query ``name`` (``<name>_pg`` or ``<name>_sqlite`` in
        storage/sql)."""
        return f"{name}_{self.variant_suffix}"

    async def fetch(self, name: str, *, conn: AsyncConnection | None = None,
                    **params: Any) -> list[Row]:
        raise NotImplementedError

    async def fetchrow(self, name: str, *, conn: AsyncConnection | None = None,
                       **params: Any) -> Row | None:
        rows = await self.fetch(name, conn=conn, **params)
        return rows[0] if rows else None

    async def fetchval(self, name: str, *, conn: AsyncConnection | None = None,
                       **params: Any) -> Any:
        row = await self.fetchrow(name, conn=conn, **params)
        return None if row is None else next(iter(row.values()))

    async def execute(self, name: str, *, conn: AsyncConnection | None = None,
                      **params: Any) -> int:
        """Run a write; the rows it changed."""
        raise NotImplementedError

    async def execute_many(self, name: str, *, conn: AsyncConnection,
                           rows: list[dict[str, Any]]) -> None:
        """Run a write once per parameter set of ``rows``, inside ``conn``'s transaction."""
        if rows:
            await conn.execute(self._text(name), rows)

    def _text(self, name: str) -> Any:
        raise NotImplementedError

    async def notify(self, event: Event, *, conn: AsyncConnection | None = None) -> None:
        """Send ``event`` to the listeners (inside ``conn``'s transaction: when it commits).
        SQLite has none: its waiters read the version (:mod:`storage.events`)."""

    def waiter(self) -> VersionWaiter:
        """How this backend waits for a session's version to move (``Store.wait_for_version``)."""
        raise NotImplementedError

    def insert(self, table: sa.Table) -> Any:
        """``INSERT`` with the dialect's ``ON CONFLICT`` clauses."""
        raise NotImplementedError

    @property
    def prepare_append(self) -> Callable[[Sequence[Message], str | None], PreparedAppend]:
        """How this backend's append wants a batch of (messages, run model) prepared: a
        picklable callable, so that another thread or process can run it."""
        from compactd.storage.store import prepare_append

        return functools.partial(prepare_append, encoded=self.encodes_appends)

    def prepared_here(self, batch: PreparedAppend) -> bool:
        """Whether ``batch`` was prepared as this backend's append takes it."""
        return (batch.texts is not None) == self.encodes_appends

    def append_processes(self, configured: int) -> int:
        """How many of ``configured`` CPU processes should prepare append bodies. A batch of JSON
        text is plain data (strings, numbers, tool links), cheap to send back from a process;
        one that holds the parsed messages costs the receiver more to unpickle than to build."""
        return configured if self.encodes_appends else 0

    async def close(self) -> None:
        """Give back what the connector holds (the engine is its owner's to dispose of)."""

    async def plan_for_each_search(self, conn: AsyncConnection) -> None:
        """Plan the searches in the rest of ``conn``'s transaction for their own values, not
        once for any value (the query ``plan_for_each_search`` says why)."""

    # -------------------------------------------------------------------------------------
    # the operations each backend implements whole

    async def append(self, session_id: str, batch: PreparedAppend, now: dt.datetime, *,
                     signal_if: Callable[[SessionInfo], bool] | None,
                     signal_ttl_s: float) -> AppendResult:
        """Store a prepared batch (prepared with ``encoded=self.encodes_appends``): gapless
        seqs, the totals, the tool links; with ``signal_if``, the pending-signal mark when it
        holds on the new totals and no mark younger than ``signal_ttl_s`` is set."""
        raise NotImplementedError

    async def append_keyed(self, session_id: str, batch: PreparedAppend, now: dt.datetime,
                           key: AppendKey, *, signal_if: Callable[[SessionInfo], bool] | None,
                           signal_ttl_s: float) -> AppendResult:
        """:meth:`append` made with an idempotency key: when ``key`` has a live row, the append
        made with it is answered (``replayed``; :class:`IdempotencyKeyReused` for another
        batch) and nothing is stored; else the batch is stored and its result recorded under
        the key, in one transaction, so an append that committed and one that did not are
        never confused."""
        raise NotImplementedError

    async def claim(self, session_id: str, *, run_id: str, owner: str, trigger: str,
                    lease_s: float, now: dt.datetime, task_id: str | None,
                    bulk_job_id: str | None) -> Claim | Busy | Skipped:
        """Take the lease on a session as run ``run_id`` (see :meth:`Store.claim`)."""
        raise NotImplementedError

    async def commit(self, session_id: str, *, run_id: str, fence: int,
                     replacements: Sequence[Replacement],
                     expected: Sequence[tuple[int, int]] | None, end: RunEnd | None,
                     now: dt.datetime) -> SessionInfo:
        """Apply checked replacements under the fence (see :meth:`Store.commit`)."""
        raise NotImplementedError

    async def write_recall_bodies(self, session_id: str, rows: Sequence[RecallBody]) -> None:
        """Fill pending originals of recall's index with their indexed text, and the bytes of
        the nodes they belong to, in one short transaction."""
        raise NotImplementedError

    # Recall's searches: each backend's form of the query takes the parameters it names (a
    # LIKE pattern for PostgreSQL's trigram index, an FTS5 phrase for SQLite's).

    async def search_exact(self, conn: AsyncConnection, **params: Any) -> list[Row]:
        return await self.fetch(self._variant("history_search_exact"), conn=conn, **params)

    async def search_pending(self, conn: AsyncConnection, **params: Any) -> list[Row]:
        return await self.fetch(self._variant("history_search_pending"), conn=conn, **params)

    async def search_word(self, conn: AsyncConnection, **params: Any) -> list[Row]:
        return await self.fetch(self._variant("history_search_word"), conn=conn, **params)

    async def search_held(self, conn: AsyncConnection, **params: Any) -> list[Row]:
        return await self.fetch(self._variant("history_search_held"), conn=conn, **params)

    async def recent_summary_runs(self, statuses: Sequence[str], *, since: dt.datetime,
                                  limit: int) -> list[Row]:
        """The newest ``limit`` ended runs of ``statuses`` that wrote a summary, newest first,
        in one statement (each backend's form takes the list as it can)."""
        return await self.fetch(self._variant("recent_summary_runs"),
                                status_list=list(statuses), statuses=dumps(list(statuses)),
                                since=since, limit=limit)


class PostgresConnector(Connector):
    """Named queries on asyncpg connections: aiosql loaded their text and parameter order once,
    and asyncpg runs them directly (its statement cache prepares each once per connection)."""

    encodes_appends = True
    variant_suffix = "pg"

    def __init__(self, engine: AsyncEngine, *, kept: int = 1) -> None:
        self.engine = engine
        self._kept = KeptConnections(engine, kept)

    async def close(self) -> None:
        await self._kept.close()

    async def fetch(self, name: str, *, conn: AsyncConnection | None = None,
                    **params: Any) -> list[Row]:
        if conn is not None:
            return [r._mapping for r in await conn.execute(_named_text(name), params)]
        text, args = _positional(name, params)
        async with self._kept.use() as raw:
            rows: list[Row] = await raw.fetch(text, *args)
            return rows

    async def fetchrow(self, name: str, *, conn: AsyncConnection | None = None,
                       **params: Any) -> Row | None:
        if conn is not None:
            return await super().fetchrow(name, conn=conn, **params)
        text, args = _positional(name, params)
        async with self._kept.use() as raw:
            row: Row | None = await raw.fetchrow(text, *args)
            return row

    async def fetchval(self, name: str, *, conn: AsyncConnection | None = None,
                       **params: Any) -> Any:
        if conn is not None:
            return await super().fetchval(name, conn=conn, **params)
        text, args = _positional(name, params)
        async with self._kept.use() as raw:
            return await raw.fetchval(text, *args)

    async def execute(self, name: str, *, conn: AsyncConnection | None = None,
                      **params: Any) -> int:
        if conn is not None:
            return int((await conn.execute(_named_text(name), params)).rowcount)
        text, args = _positional(name, params)
        async with self._kept.use() as raw:
            status: str = await raw.execute(text, *args)
        return int(status.rsplit(" ", 1)[-1])

    def insert(self, table: sa.Table) -> Any:
        return pg_insert(table)

    async def notify(self, event: Event, *, conn: AsyncConnection | None = None) -> None:
        await self.execute("notify", conn=conn, payload=event.dumps())

    def waiter(self) -> VersionWaiter:
        # The commit's notification wakes the waiter.
        return Listener(self.engine)

    def _text(self, name: str) -> Any:
        return _named_text(name)

    async def plan_for_each_search(self, conn: AsyncConnection) -> None:
        await self.execute("plan_for_each_search", conn=conn)

    async def append(self, session_id: str, batch: PreparedAppend, now: dt.datetime, *,
                     signal_if: Callable[[SessionInfo], bool] | None,
                     signal_ttl_s: float) -> AppendResult:
        """One call of ``compactd_append`` (one round trip); the pending-signal mark is one more
        autocommit statement, made only when the trigger fires and no mark is live (BEGIN and
        COMMIT would be two more round trips on the runtime's critical path)."""
        return await self._append(session_id, batch, now, None, signal_if=signal_if,
                                  signal_ttl_s=signal_ttl_s)

    async def append_keyed(self, session_id: str, batch: PreparedAppend, now: dt.datetime,
                           key: AppendKey, *, signal_if: Callable[[SessionInfo], bool] | None,
                           signal_ttl_s: float) -> AppendResult:
        """The same one call with the key: ``compactd_append`` answers from the key's row or
        appends and records the key; the mark after it, as an unkeyed append makes it."""
        return await self._append(session_id, batch, now, key, signal_if=signal_if,
                                  signal_ttl_s=signal_ttl_s)

    async def _append(self, session_id: str, batch: PreparedAppend, now: dt.datetime,
                      key: AppendKey | None, *, signal_if: Callable[[SessionInfo], bool] | None,
                      signal_ttl_s: float) -> AppendResult:
        try:
            row = await self.fetchrow("append", **_append_params(session_id, batch, now, key))
            if key is not None and row is not None and row["key_request_sha256"] is not None:
                return replayed(row, key, batch.tokens)
        except Exception as exc:
            raise _append_error(exc) from None
        return await self._signal(_appended(row, session_id, batch), now, signal_if,
                                  signal_ttl_s)

    async def _signal(self, result: AppendResult, now: dt.datetime,
                      signal_if: Callable[[SessionInfo], bool] | None,
                      signal_ttl_s: float) -> AppendResult:
        """The pending-signal mark when ``signal_if`` holds on the append's totals."""
        info = result.session
        if signal_if is None or not signal_if(info) or info.signal_live(now, signal_ttl_s):
            return result
        signalled = bool(await self.execute(
            "mark_signal", session_id=info.id, now=now,
            stale_before=now - dt.timedelta(seconds=signal_ttl_s)))
        return dataclasses.replace(result, signalled=signalled)

    async def claim(self, session_id: str, *, run_id: str, owner: str, trigger: str,
                    lease_s: float, now: dt.datetime, task_id: str | None,
                    bulk_job_id: str | None) -> Claim | Busy | Skipped:
        """A session with no lease in one call of ``compactd_claim``; a leased session, an
        expired lease to close and a bulk item (which checks its job) with the general
        statements, waiting for the session's row lock no longer than ``CLAIM_LOCK_WAIT_S``
        (less when the run's deadline comes first)."""
        try:
            return await self._claim(session_id, run_id=run_id, owner=owner, trigger=trigger,
                                     lease_s=lease_s, now=now, task_id=task_id,
                                     bulk_job_id=bulk_job_id)
        except LockNotAvailable:
            raise row_stayed_locked(session_id) from None

    async def _claim(self, session_id: str, *, run_id: str, owner: str, trigger: str,
                     lease_s: float, now: dt.datetime, task_id: str | None,
                     bulk_job_id: str | None) -> Claim | Busy | Skipped:
        expires = now + dt.timedelta(seconds=lease_s)
        if bulk_job_id is None:
            row = await self.fetchrow("claim_free", session_id=session_id, run_id=run_id,
                                      owner=owner, trigger=trigger, expires=expires, now=now,
                                      task_id=task_id)
            if row is not None:
                info = session_from_record(row)
                if info.lease_run_id == run_id:
                    return Claim(session=info, run_id=run_id, fence=info.lease_fence,
                                 owner=owner, expires_at=expires)
        async with transaction(self.engine) as conn:
            left = deadline_left_s()
            wait_s = CLAIM_LOCK_WAIT_S if left is None else min(CLAIM_LOCK_WAIT_S, left)
            await self.execute("set_lock_wait", conn=conn, ms=f"{max(1, int(wait_s * 1000))}ms")
            return await claim_in(conn, session_id, run_id=run_id, owner=owner, trigger=trigger,
                                  lease_s=lease_s, now=now, task_id=task_id,
                                  bulk_job_id=bulk_job_id)

    async def commit(self, session_id: str, *, run_id: str, fence: int,
                     replacements: Sequence[Replacement],
                     expected: Sequence[tuple[int, int]] | None, end: RunEnd | None,
                     now: dt.datetime) -> SessionInfo:
        """The commit as one statement, in autocommit: a call of ``compactd_commit``, and with
        ``end`` the run row's result and its bulk item's in the same statement
        (``commit_ending``). As a transaction around the call that was three more round trips
        (BEGIN, the run row, COMMIT), with appends waiting on the session row meanwhile."""
        name, params = _commit_params(session_id, run_id=run_id, fence=fence,
                                      replacements=replacements, expected=expected, end=end,
                                      now=now)
        try:
            record = await self.fetchrow(name, **params)
        except Exception as exc:
            mapped = _commit_error(exc, session_id, run_id, fence, replacements)
            if mapped is None:
                raise  # translated like every driver error (lock timeout, lost connection)
            raise mapped from None
        if record is None:
            raise SessionNotFound(session_id)
        return session_from_record(record)

    async def write_recall_bodies(self, session_id: str, rows: Sequence[RecallBody]) -> None:
        # One statement with array parameters.
        await self.execute("recall_set_bodies", session_id=session_id,
                           seqs=[r.seq for r in rows], sizes=[r.bytes for r in rows],
                           bodies=[r.body for r in rows])


class SQLiteConnector(Connector):
    encodes_appends = False
    variant_suffix = "sqlite"
    deletion_pace = DeletionPace(batch_s=SQLITE_DELETE_BATCH_S, rest_s=SQLITE_DELETE_REST_S,
                                 rest_ratio=1.0)

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    async def fetch(self, name: str, *, conn: AsyncConnection | None = None,
                    **params: Any) -> list[Row]:
        async with self._connection(name, conn) as c:
            return [r._mapping for r in await c.execute(_sqlite_text(name, *_typed(params)),
                                                        params)]

    async def execute(self, name: str, *, conn: AsyncConnection | None = None,
                      **params: Any) -> int:
        async with self._connection(name, conn) as c:
            result = await c.execute(_sqlite_text(name, *_typed(params)), params)
            return int(result.rowcount)

    def insert(self, table: sa.Table) -> Any:
        return sqlite_insert(table)

    def waiter(self) -> VersionWaiter:
        # No notifications: the waiter reads the version.
        return VersionPoller()

    def _text(self, name: str) -> Any:
        return _sqlite_text(name)

    async def append(self, session_id: str, batch: PreparedAppend, now: dt.datetime, *,
                     signal_if: Callable[[SessionInfo], bool] | None,
                     signal_ttl_s: float) -> AppendResult:
        """The general statements in one transaction, the pending-signal mark among them."""
        async with transaction(self.engine) as conn:
            return await append_in(conn, session_id, batch, now, signal_if=signal_if,
                                   signal_ttl_s=signal_ttl_s,
                                   mark_signal=functools.partial(self.execute, "mark_signal"))

    async def append_keyed(self, session_id: str, batch: PreparedAppend, now: dt.datetime,
                           key: AppendKey, *, signal_if: Callable[[SessionInfo], bool] | None,
                           signal_ttl_s: float) -> AppendResult:
        """The key's row, else the general statements and the key's row written, in one
        transaction."""

        async def attempt() -> AppendResult | None:
            try:
                async with transaction(self.engine) as conn:
                    found = await self.fetchrow("append_key_find", conn=conn,
                                                session_id=session_id, key=key.key,
                                                live_after=key.live_after)
                    if found is not None:
                        return replayed(found, key, batch.tokens)
                    result = await append_in(
                        conn, session_id, batch, now, signal_if=signal_if,
                        signal_ttl_s=signal_ttl_s,
                        mark_signal=functools.partial(self.execute, "mark_signal"))
                    if await self.fetchval("append_key_store", conn=conn,
                                           **key_params(session_id, key, result, now)):
                        return result
                    raise KeyTaken
            except KeyTaken:
                return None

        return await first_with_key(attempt)

    async def claim(self, session_id: str, *, run_id: str, owner: str, trigger: str,
                    lease_s: float, now: dt.datetime, task_id: str | None,
                    bulk_job_id: str | None) -> Claim | Busy | Skipped:
        """The general statements in one transaction, which waits for the database's write
        lock as every write waits for it."""
        async with transaction(self.engine) as conn:
            return await claim_in(conn, session_id, run_id=run_id, owner=owner,
                                  trigger=trigger, lease_s=lease_s, now=now, task_id=task_id,
                                  bulk_job_id=bulk_job_id)

    async def commit(self, session_id: str, *, run_id: str, fence: int,
                     replacements: Sequence[Replacement],
                     expected: Sequence[tuple[int, int]] | None, end: RunEnd | None,
                     now: dt.datetime) -> SessionInfo:
        """The general statements in one transaction (the recall trigger records each replace
        node as the events are inserted)."""
        async with transaction(self.engine) as conn:
            return await commit_in(conn, session_id, run_id=run_id, fence=fence,
                                   replacements=replacements, expected=expected, end=end,
                                   now=now)

    async def write_recall_bodies(self, session_id: str, rows: Sequence[RecallBody]) -> None:
        # One statement per row, in one transaction (the FTS5 trigger indexes each body).
        async with transaction(self.engine) as conn:
            await self.execute_many("recall_set_body", conn=conn, rows=[
                {"session_id": session_id, "seq": r.seq, "bytes": r.bytes, "body": r.body}
                for r in rows])
            await self.execute_many("recall_node_bytes", conn=conn, rows=[
                {"session_id": session_id, "seq": seq}
                for seq in sorted({r.node_seq for r in rows})])

    @contextlib.asynccontextmanager
    async def _connection(self, name: str, conn: AsyncConnection | None
                          ) -> AsyncIterator[AsyncConnection]:
        if conn is not None:
            yield conn
        elif sql.writes(name):
            async with transaction(self.engine) as c:
                yield c
        else:
            async with connection(self.engine) as c:
                yield c


def connector_for(engine: AsyncEngine, *, kept: int = 1) -> Connector:
    """The engine's connector; on PostgreSQL it keeps up to ``kept`` connections for the named
    queries (see :class:`KeptConnections`)."""
    if engine.dialect.name == "sqlite":
        return SQLiteConnector(engine)
    return PostgresConnector(engine, kept=kept)



def _positional(name: str, params: Mapping[str, Any]) -> tuple[str, list[Any]]:
    """Query ``name`` for asyncpg: its ``$n`` text and ``params`` in its parameters' order."""
    text, order = sql.positional(name)
    return text, [params[p] for p in order]


# Result columns typed by name, from the tables: SQLite returns datetimes and JSON as text.
_RESULT_TYPES: dict[str, Any] = {
    c.name: c.type for table in t.metadata.tables.values() for c in table.c
    if isinstance(c.type, sa.JSON | t.UTCDateTime)}


def _typed(params: Mapping[str, Any]) -> tuple[str, ...]:
    """The parameters bound as aware UTC datetimes (stored naive on SQLite)."""
    return tuple(sorted(k for k, v in params.items() if isinstance(v, dt.datetime)))


@functools.cache
def _sqlite_text(name: str, *datetimes: str) -> Any:
    text = sa.text(sql.sqlite_text(name)).bindparams(
        *(sa.bindparam(p, type_=t.UTCDateTime) for p in datetimes))
    return text.columns(**_RESULT_TYPES) if sql.returns_rows(name) else text


@functools.cache
def _named_text(name: str) -> Any:
    """A query as SQLAlchemy text, for a statement inside a transaction on PostgreSQL."""
    return sa.text(sql.postgres_text(name))


def _commit_params(session_id: str, *, run_id: str, fence: int,
                   replacements: Sequence[Replacement],
                   expected: Sequence[tuple[int, int]] | None, end: RunEnd | None,
                   now: dt.datetime) -> tuple[str, dict[str, Any]]:
    """The query (``commit`` or ``commit_ending``) and its parameters: the replacements as
    arrays, one element each."""
    placed = any(rep.placed for rep in replacements)
    recalls = [node_recall(rep.payload) for rep in replacements]
    params: dict[str, Any] = {
        "session_id": session_id, "run_id": run_id, "fence": fence, "now": now,
        "seqs": [q for rep in replacements for q in rep.seqs],
        "counts": [len(rep.seqs) for rep in replacements],
        "kinds": [rep.kind for rep in replacements],
        "payloads": [dumps(node_payload(rep, run_id)) for rep in replacements],
        "tokens": [rep.tokens for rep in replacements],
        "journal_kinds": [rep.journal_kind for rep in replacements],
        "journals": [dumps(journal_payload(rep, run_id)) for rep in replacements],
        "expected_pos": [pos for pos, _ in expected] if expected else None,
        "expected_seq": [seq for _, seq in expected] if expected else None,
        "end_payload": dumps(end_payload(run_id, end)) if end is not None else None,
        # NULL unless a replacement is placed: compactd_commit then writes in one batch.
        "before": [rep.before for rep in replacements] if placed else None,
        "after": [rep.after for rep in replacements] if placed else None,
        # What each node states about itself for recall, read here: the payload may hold
        # what no JSON operator of PostgreSQL reads (a NUL).
        "refs": [r.ref for r in recalls], "firsts": [r.first for r in recalls],
        "lasts": [r.last for r in recalls],
        # NULL unless a node adds to a counter kept by name.
        "node_counts": _node_counts(replacements), **_keeps(replacements)}
    if end is None:
        return "commit", {**params, "event": commit_event_fields(session_id, run_id,
                                                                 RunStatus.RUNNING)}
    return "commit_ending", {**params, **_run_end_params(end),
                             "event": commit_event_fields(session_id, run_id, end.outcome)}


def _keeps(replacements: Sequence[Replacement]) -> dict[str, list[int] | None]:
    """The nodes each replacement keeps inside its run, flattened as its seqs are; NULL unless
    one keeps any."""
    if not any(rep.keeps for rep in replacements):
        return {"keeps": None, "keep_counts": None}
    return {"keeps": [q for rep in replacements for q in rep.keeps],
            "keep_counts": [len(rep.keeps) for rep in replacements]}


def _node_counts(replacements: Sequence[Replacement]) -> list[str | None] | None:
    counts = [node_counts(rep.payload, rep.tokens) for rep in replacements]
    return None if all(c is None for c in counts) else [
        None if c is None else dumps(c) for c in counts]


def _run_end_params(end: RunEnd) -> dict[str, Any]:
    """The run row's result and its bulk item's state, as ``commit_ending`` takes them."""
    return {**{column: _json_or_none(value) if column in RUN_JSON_COLUMNS else value
               for column, value in run_end_values(end).items()},
            "item_state": bulk_item_state(end.outcome), "item_done": ItemState.DONE}


def _commit_error(exc: BaseException, session_id: str, run_id: str, fence: int,
                  replacements: Sequence[Replacement]) -> CompactdError | None:
    """compactd's own error for compactd_commit's SQLSTATEs; None for any other error, which
    the caller re-raises for the usual translation (CD404 included)."""
    pg = driver_error(exc)
    code, detail = getattr(pg, "sqlstate", None), getattr(pg, "detail", None) or ""
    if code == "CD409":
        return lease_lost(session_id, run_id, fence, detail)
    if code == "CD410":
        if detail == "prefix":
            return prefix_changed(session_id, run_id)
        what, _, index = detail.partition(":")
        return refused(replacements[int(index) - 1], what)
    return None


def _append_params(session_id: str, batch: PreparedAppend, now: dt.datetime,
                   key: AppendKey | None) -> dict[str, Any]:
    links, texts = batch.links, batch.texts
    assert links is not None and texts is not None
    return {"session_id": session_id, "payloads": texts, "tokens": list(batch.tokens),
            "now": now, "call_ids": [c[0] for c in links.calls],
            "call_idx": [c[1] for c in links.calls],
            "call_result_idx": [c[2] for c in links.calls],
            "ext_ids": [e[0] for e in links.external], "ext_idx": [e[1] for e in links.external],
            "counts": list(batch.counts) if batch.counts else None,
            "counts_sum": batch.counts_sum,
            "key": None if key is None else key.key,
            "request_sha256": None if key is None else key.request_sha256,
            "key_live_after": None if key is None else key.live_after}


def _appended(row: Row | None, session_id: str, batch: PreparedAppend) -> AppendResult:
    """``compactd_append``'s row as the append's result."""
    if row is None:
        raise SessionNotFound(session_id)
    info = session_from_record(row)
    n = len(batch.tokens)
    return AppendResult(session=info, first_seq=info.last_seq - n + 1, last_seq=info.last_seq,
                        tokens=batch.tokens)


def _json_or_none(value: Any) -> str | None:
    return None if value is None else dumps(value)


_LINK_ERRORS = {
    "CD001": (REUSED_OPEN, "tool_calls"),
    "CD002": (ORPHAN, "tool_call_id"),
    "CD003": (ANSWERED, "tool_call_id"),
}


def _append_error(exc: Exception) -> Exception:
    pg = driver_error(exc)
    code = getattr(pg, "sqlstate", None)
    if code in _LINK_ERRORS:
        reason, field = _LINK_ERRORS[code]
        return InvalidMessage(reason.format(id=pg.detail),  # type: ignore[attr-defined]
                              index=int(pg.hint), field=field)  # type: ignore[attr-defined]
    if isinstance(exc, CompactdError):
        return exc
    return translate(exc)


