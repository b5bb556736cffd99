"""The repository: sessions, the event log and the surface here, the other rows in the mixins
below; like all SQL, theirs is built in storage/ and nowhere else.

:class:`Store` wraps one async engine. Every method is one short transaction (or one read), takes
plain values, returns the records of ``storage.records`` and raises only compactd exceptions.
Leases, run records, bulk jobs, sweeps, loop-guard flags, recall, the recall index, leads and
deletion live in the mixins of ``storage.leases``, ``storage.runs``, ``storage.bulk_jobs``,
``storage.sweeps``, ``storage.loop_guard``, ``storage.recall``, ``storage.recall_index``,
``storage.leads`` and ``storage.deletion``. What differs between PostgreSQL and SQLite is the
connector's (``storage.connectors``); the SQL text is in ``storage/sql``.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from compactd.storage import schema as t
from compactd.storage.bulk_jobs import BulkJobsMixin
from compactd.storage.connectors import connector_for
from compactd.storage.connectors_general import read_session
from compactd.storage.counters import Counts, batch_counts, summed
from compactd.storage.database import (
    connection,
    create_engine,
    snapshot,
    transaction,
)
from compactd.storage.deletion import DeletionMixin
from compactd.storage.errors import (
    InvalidMessage,
    SessionExists,
    SessionNotFound,
    StorageError,
)
from compactd.storage.events import Event
from compactd.storage.ids import (
    MAX_INT32,
    check_count,
    check_id,
    check_idempotency_key,
    check_seconds,
    check_session_id,
    check_tenant,
)
from compactd.storage.instructions import (
    carry_instructions,
    check_instructions,
    first_instructions,
    merge_instructions,
)
from compactd.storage.kinds import REPLACE_KINDS, NodeKind
from compactd.storage.leads import LeadsMixin
from compactd.storage.leases import LeasesMixin
from compactd.storage.loop_guard import LoopGuardMixin
from compactd.storage.messages import (
    BatchLinks,
    Message,
    from_payload,
    without_reserved,
)
from compactd.storage.recall import RecallMixin
from compactd.storage.recall_index import RecallIndexMixin
from compactd.storage.records import (
    APPEND_KEY_WINDOW_S,
    GROWTH_WINDOW_S,
    AppendedMessage,
    AppendKey,
    AppendResult,
    EventRecord,
    SessionInfo,
    VerifyResult,
    utcnow,
)
from compactd.storage.runs import RunsMixin, recorded_instructions
from compactd.storage.schema import SESSION_COLUMNS, dumps, session_from_record, session_from_row
from compactd.storage.surface import (
    LoggedEvent,
    ReplayError,
    Surface,
    SurfaceNode,
    replay,
)
from compactd.storage.sweeps import SweepsMixin
from compactd.storage.tokens import counter_for

logger = logging.getLogger(__name__)

_SESSION_CACHE_MAX = 10_000
# The task id of a manual mark that stands for no queued task, only for the instructions a busy
# run handed back (Store.keep_manual); the next manual request takes it over. Celery's task ids
# are never empty. Its queued_at is long past, so a release before this one, which knows no
# such mark, takes it over as a stale one instead of answering with a task that does not exist.
KEPT_TASK_ID = ""
KEPT_QUEUED_AT = dt.datetime(2000, 1, 1, tzinfo=dt.UTC)


def envelope_tokens(envelope: dict[str, Any] | None, run_model: str | None) -> int:
    """Tokens the runtime sends with every call besides the surface: system prompt and tools."""
    if not envelope:
        return 0
    counter = counter_for(run_model)
    total = 0
    system = envelope.get("system")
    if system:
        total += counter.count_message(Message(role="system", content=str(system)))
    tools = envelope.get("tools")
    if tools:
        total += counter.count_text(json.dumps(tools, ensure_ascii=False, separators=(",", ":")))
    return total


@dataclass(frozen=True, slots=True)
class PreparedAppend:
    """An append with the CPU-bound part of storing it done: token counts and payloads, or
    for PostgreSQL the payloads' JSON text and the batch's tool links.

    :func:`prepare_append` does no I/O, so a server can build it off its event loop: for a
    batch of 110,000 messages this is seconds of CPU that would otherwise hold every other
    request waiting. An encoded batch keeps only strings and numbers (``messages`` and
    ``payloads`` are None): the PostgreSQL append sends nothing else, and a few hundred
    thousand live dicts would make each of the garbage collector's full passes, on whatever
    thread it runs, take longer than a whole small request.
    """

    run_model: str | None
    tokens: tuple[int, ...]
    messages: Sequence[Message] | None = None
    payloads: list[dict[str, Any]] | None = None
    texts: list[str] | None = None
    links: BatchLinks | None = None
    # What each message adds to the counters kept by name (``storage.counters``), and their
    # sum; empty and None while no such counter is registered. Encoded, as JSON text.
    counts: Sequence[Counts | None] | Sequence[str | None] = ()
    counts_sum: Counts | str | None = None


def prepare_append(messages: Sequence[Message], run_model: str | None, *,
                   encoded: bool = False) -> PreparedAppend:
    """Count and serialize a batch for a session whose run model is ``run_model``; with
    ``encoded``, what the PostgreSQL append sends instead of the messages. Raises
    InvalidMessage for tool links the batch itself breaks."""
    counter = counter_for(run_model)
    tokens = tuple(counter.count_message(m) for m in messages)
    payloads = [m.to_payload() for m in messages]
    counts, counts_sum = batch_counts(messages, tokens)
    if not encoded:
        return PreparedAppend(run_model, tokens, messages=messages, payloads=payloads,
                              counts=counts, counts_sum=counts_sum)
    return PreparedAppend(run_model, tokens, texts=[dumps(p) for p in payloads],
                          links=BatchLinks(messages),
                          counts=[None if c is None else dumps(c) for c in counts],
                          counts_sum=None if counts_sum is None else dumps(counts_sum))


def request_digest(batch: PreparedAppend) -> str:
    """The SHA-256 of a batch's messages as stored: what tells a retried append (the same
    messages) from another append made with its idempotency key."""
    texts = batch.texts if batch.texts is not None else map(dumps, batch.payloads or ())
    digest = hashlib.sha256()
    for text in texts:
        # JSON text escapes every control character, so a NUL separates messages unambiguously.
        digest.update(text.encode("utf-8", "surrogatepass"))
        digest.update(b"\0")
    return digest.hexdigest()


class Store(LeasesMixin, RunsMixin, BulkJobsMixin, SweepsMixin, LoopGuardMixin, RecallMixin,
            RecallIndexMixin, LeadsMixin, DeletionMixin):
    """Sessions, the event log and the surface."""

    def __init__(self, engine: AsyncEngine, *, kept_connections: int = 1) -> None:
        self.engine = engine
        # The runtime keeps one connection (append, poll, signal mark); a worker a few.
        self.db = connector_for(engine, kept=kept_connections)
        # run_model never changes once a session exists, so appends can count tokens before
        # their transaction without reading the session first.
        self._run_models: dict[str, str | None] = {}
        self._waiter = self.db.waiter()

    @classmethod
    def from_url(cls, url: str, *, kept_connections: int = 1, **kwargs: Any) -> Store:
        return cls(create_engine(url, **kwargs), kept_connections=kept_connections)

    async def close(self) -> None:
        await self._waiter.close()
        await self.db.close()
        await self.engine.dispose()

    # ---------------------------------------------------------------------------------------
    # sessions

    async def create_session(
        self, session_id: str, *, tenant: str = "default", run_model: str | None = None,
        context_window: int | None = None, envelope: dict[str, Any] | None = None,
        policy: dict[str, Any] | None = None, now: dt.datetime | None = None,
    ) -> SessionInfo:
        """Create a session, or return it when it exists with compatible settings.

        Settings given here that differ from the stored ones raise :class:`SessionExists`,
        except ``envelope`` and ``policy``, which a runtime may update (its tools can change).
        """
        info, _ = await self.open_session(
            session_id, tenant=tenant, run_model=run_model, context_window=context_window,
            envelope=envelope, policy=policy, now=now)
        return info

    async def open_session(
        self, session_id: str, *, tenant: str = "default", run_model: str | None = None,
        context_window: int | None = None, envelope: dict[str, Any] | None = None,
        policy: dict[str, Any] | None = None, now: dt.datetime | None = None,
    ) -> tuple[SessionInfo, bool]:
        """:meth:`create_session`, and whether this call created the session.

        Idempotent under concurrency: callers racing to create one new session all get it (one
        of them created it), as if they had come one after the other.
        """
        check_session_id(session_id)
        check_tenant(tenant)
        if run_model is not None:
            check_id(run_model, field="run_model", what="a run model")
        if context_window is not None:
            check_count(context_window, "context_window", minimum=1)
        now = now or utcnow()
        env_tokens = envelope_tokens(envelope, run_model)
        created = False
        async with transaction(self.engine) as conn:
            row = (await conn.execute(
                sa.select(*SESSION_COLUMNS).where(t.sessions.c.id == session_id)
                .with_for_update())).first()
            if row is None:
                # ON CONFLICT: a racing caller's insert of the same id commits first and this
                # one reads its row below, instead of failing on the primary key.
                insert = self.db.insert(t.sessions).on_conflict_do_nothing()
                created = (await conn.execute(insert.values(
                    id=session_id, tenant=tenant, run_model=run_model,
                    context_window=context_window, envelope=envelope,
                    envelope_tokens=env_tokens, policy=policy, surface_version=0,
                    surface_tokens=0, surface_messages=0, last_seq=0, last_position=0,
                    lease_fence=0, created_at=now).returning(t.sessions.c.id))).first() \
                    is not None
                if not created:
                    row = (await conn.execute(
                        sa.select(*SESSION_COLUMNS).where(t.sessions.c.id == session_id)
                        .with_for_update())).first()
            if row is not None:
                existing = session_from_row(row)
                for name, given, stored in (("tenant", tenant, existing.tenant),
                                            ("run_model", run_model, existing.run_model)):
                    if given != stored:
                        raise SessionExists(
                            f"session {session_id!r} exists with {name}={stored!r}, "
                            f"not {given!r}")
                updates: dict[str, Any] = {}
                if context_window is not None and context_window != existing.context_window:
                    updates["context_window"] = context_window
                if envelope is not None and envelope != existing.envelope:
                    updates.update(envelope=envelope, envelope_tokens=env_tokens)
                if policy is not None and policy != existing.policy:
                    updates["policy"] = policy
                if "context_window" in updates or "policy" in updates:
                    updates["sweep_key"] = None  # its trigger thresholds are resolved again
                if updates:
                    await conn.execute(t.sessions.update()
                                       .where(t.sessions.c.id == session_id).values(**updates))
            info = await self._session(conn, session_id)
        self._remember_model(session_id, info.run_model)
        return info, created

    async def set_run_model(self, session_id: str, run_model: str,
                            context_window: int | None) -> SessionInfo:
        """Move the session to another run model (the agent's model changed): its window, and
        its envelope counted again with the model's tokenizer. The messages keep the counts
        they were appended with. SessionNotFound when there is no such session."""
        check_id(run_model, field="run_model", what="a run model")
        if context_window is not None:
            check_count(context_window, "context_window", minimum=1)
        async with transaction(self.engine) as conn:
            info = await self._session(conn, session_id, lock=True)
            await conn.execute(t.sessions.update().where(t.sessions.c.id == session_id).values(
                run_model=run_model, context_window=context_window,
                envelope_tokens=envelope_tokens(info.envelope, run_model),
                # Its trigger thresholds are resolved again on the new window.
                sweep_key=None))
            info = await self._session(conn, session_id)
        self._remember_model(session_id, run_model)
        return info

    async def get_session(self, session_id: str) -> SessionInfo:
        async with connection(self.engine) as conn:
            return await self._session(conn, session_id)

    async def _session(self, conn: AsyncConnection, session_id: str, *, lock: bool = False,
                       nowait: bool = False) -> SessionInfo:
        return await read_session(conn, session_id, lock=lock, nowait=nowait)

    async def list_sessions(self, *, tenant: str | None = None, run_model: str | None = None,
                            min_tokens: int | None = None, idle_before: dt.datetime | None = None,
                            ids: Sequence[str] | None = None, after_id: str | None = None,
                            limit: int = 1000) -> list[SessionInfo]:
        """Sessions matching a filter, in id order, one keyset page at a time."""
        c = t.sessions.c
        stmt = sa.select(*SESSION_COLUMNS).order_by(c.id).limit(limit)
        if tenant is not None:
            stmt = stmt.where(c.tenant == tenant)
        if run_model is not None:
            stmt = stmt.where(c.run_model == run_model)
        if min_tokens is not None:
            stmt = stmt.where(c.surface_tokens + c.envelope_tokens >= min_tokens)
        if idle_before is not None:
            stmt = stmt.where(sa.or_(c.last_append_at.is_(None), c.last_append_at <= idle_before))
        if ids is not None:
            stmt = stmt.where(c.id.in_(list(ids)))
        if after_id is not None:
            stmt = stmt.where(c.id > after_id)
        async with connection(self.engine) as conn:
            return [session_from_row(r) for r in await conn.execute(stmt)]

    def _remember_model(self, session_id: str, run_model: str | None) -> None:
        if len(self._run_models) >= _SESSION_CACHE_MAX:
            self._run_models.clear()
        self._run_models[session_id] = run_model

    async def _run_model(self, session_id: str) -> str | None:
        if session_id not in self._run_models:
            async with connection(self.engine) as conn:
                model = (await conn.execute(sa.select(t.sessions.c.run_model)
                                            .where(t.sessions.c.id == session_id))).first()
            if model is None:
                raise SessionNotFound(session_id)
            self._remember_model(session_id, model[0])
        return self._run_models[session_id]

    async def report_usage(self, session_id: str, input_tokens: int, output_tokens: int = 0, *,
                           response_appended: bool = True,
                           surface_version: int | None = None) -> SessionInfo:
        """Record the provider's own usage for the runtime's last call: the next request holds
        its input and its output, and pressure counts both plus what is appended after the
        response. ``response_appended=False``: the response is not appended yet (the report
        came first), so when it is, ``output_tokens`` already stands for it.

        ``surface_version``: the version of the surface the reported request was built on (the
        ETag of the surface read, or an append's version). Appends since (the reply, another
        writer's messages) leave that request's messages in place and are counted on top. When
        a compaction committed after it (``SessionInfo.compacted_since``), the report describes
        a larger request than the next one and is not recorded: stored against the smaller
        surface it would fire the trigger again, and each such run would look to the loop
        guard like a compaction without relief. The session is then returned as it is. A
        version the session has not reached is refused as bad input."""
        check_count(input_tokens, "input_tokens")
        check_count(output_tokens, "output_tokens")
        if surface_version is not None:
            check_count(surface_version, "surface_version", maximum=2**63 - 1)
        if input_tokens + output_tokens > MAX_INT32:
            # Their sum is what pressure counts, in the same 32-bit arithmetic.
            raise InvalidMessage(f"input_tokens + output_tokens must be at most {MAX_INT32}",
                                 field="output_tokens")
        record = await self.db.fetchrow(
            "report_usage", session_id=session_id, input_tokens=input_tokens,
            output_tokens=output_tokens,
            unappended_tokens=0 if response_appended else output_tokens,
            surface_version=surface_version)
        if record is not None:
            info = session_from_record(record)
        else:
            # Not recorded: no such session (SessionNotFound), or a stale report.
            info = await self.get_session(session_id)
        if surface_version is not None and surface_version > info.surface_version:
            raise InvalidMessage(f"surface_version {surface_version} is newer than the "
                                 f"session's surface (version {info.surface_version})",
                                 field="surface_version")
        return info

    # ---------------------------------------------------------------------------------------
    # append

    async def append(
        self, session_id: str, messages: Sequence[Message] | PreparedAppend, *,
        now: dt.datetime | None = None,
        signal_if: Callable[[SessionInfo], bool] | None = None, signal_ttl_s: float = 60.0,
        idempotency_key: str | None = None, key_window_s: float = APPEND_KEY_WINDOW_S,
    ) -> AppendResult:
        """Append a batch in one transaction: gapless seqs, tokens counted once.

        Holds the session row only for its own transaction; a compaction holds a lease, not a
        lock, so an append never waits on one. With ``signal_if``, the pressure decision is taken
        on the new totals the append returns, and the pending-signal mark is set at most once per
        ``signal_ttl_s`` (a conditional update, so of appends racing over the trigger one sets
        it; the caller enqueues only when ``signalled`` is true). Where the append is one call of
        ``compactd_append`` (PostgreSQL), the mark is one more statement, made only when the
        trigger fires and no mark is live; elsewhere it is part of the append's transaction. A
        :class:`PreparedAppend` built for the session's run model is stored as it is (its counts
        are not taken again).

        ``idempotency_key``: an append made again with the key within ``key_window_s`` of the
        first is answered with what the first returned (``replayed``; its seqs, version and
        totals) and stores nothing, so a runtime may retry an append whose answer it lost; the
        key with another batch is refused (:class:`IdempotencyKeyReused`). Without a key the
        append is the one round trip above.
        """
        batch = messages if isinstance(messages, PreparedAppend) else None
        if not (batch.tokens if batch is not None else messages):
            raise InvalidMessage("an append needs at least one message")
        now = now or utcnow()
        run_model = await self._run_model(session_id)
        if batch is None:
            assert not isinstance(messages, PreparedAppend)
            batch = self.db.prepare_append(messages, run_model)
        elif batch.run_model != run_model or not self.db.prepared_here(batch):
            raise ValueError("the batch was prepared for another run model or backend")
        if idempotency_key is None:
            return await self.db.append(session_id, batch, now, signal_if=signal_if,
                                        signal_ttl_s=signal_ttl_s)
        check_seconds(key_window_s, "key_window_s")
        key = AppendKey(check_idempotency_key(idempotency_key), request_digest(batch),
                        now - dt.timedelta(seconds=key_window_s))
        return await self.db.append_keyed(session_id, batch, now, key, signal_if=signal_if,
                                          signal_ttl_s=signal_ttl_s)

    # ---------------------------------------------------------------------------------------
    # signals

    async def mark_signal(self, session_id: str, *, ttl_s: float,
                          now: dt.datetime | None = None) -> bool:
        """Set the pending-signal mark unless one is live; True when this call set it."""
        async with transaction(self.engine) as conn:
            marked = await self._mark_signal(conn, session_id, now or utcnow(), ttl_s)
            if not marked:
                await self._session(conn, session_id)  # SessionNotFound beats "already queued"
            return marked

    async def _mark_signal(self, conn: AsyncConnection, session_id: str, now: dt.datetime,
                           ttl_s: float) -> bool:
        return bool(await self.db.execute(
            "mark_signal", conn=conn, session_id=session_id, now=now,
            stale_before=now - dt.timedelta(seconds=ttl_s)))

    async def clear_signal(self, session_id: str) -> SessionInfo | None:
        """Clear the pending-signal mark; the session as it is after that, None when there is
        no such session (callers run this in cleanup, where the original error must win).

        Every automatic run ends with this, so it is one statement, and it returns the row the
        worker's follow-up check reads instead of a second query."""
        record = await self.db.fetchrow("clear_signal", session_id=session_id)
        return None if record is None else session_from_record(record)

    async def mark_manual(self, session_id: str, task_id: str, *, ttl_s: float,
                          now: dt.datetime | None = None,
                          instructions: Sequence[str] = ()) -> str:
        """Record ``task_id`` as the session's queued manual run unless one younger than
        ``ttl_s`` is recorded; the task id that holds the mark (``task_id`` when this call
        took it). ``instructions`` join the held mark's distinct ones (a request coalesced
        into it keeps its focus); over the bound nothing is changed (InvalidMessage). A
        missing session raises SessionNotFound."""
        now = now or utcnow()
        for text in instructions:
            check_instructions(text)
        m = t.manual_requests
        async with transaction(self.engine) as conn:
            await self._session(conn, session_id)
            # The task that takes the mark over takes the instructions on it: those a busy run
            # left (keep_manual), and those of a stale mark, whose task never reads them (its
            # clear finds another task on the mark, or its message was lost).
            taken_over = (m.c.queued_at <= now - dt.timedelta(seconds=ttl_s)) \
                | (m.c.task_id == KEPT_TASK_ID)
            carried = (await conn.execute(
                sa.select(m.c.instructions)
                .where(m.c.session_id == session_id, taken_over)
                .with_for_update())).scalar()
            merged, dropped = carry_instructions(carried or (), instructions)
            if dropped:
                # Not silently: the texts are in the log, as the requests that gave them
                # were answered queued.
                logger.warning("a manual request took over a mark no task will start; the "
                               "oldest %d of its instructions gave way to the request's: %s",
                               len(dropped), json.dumps(dropped, ensure_ascii=False),
                               extra={"action": "manual.instructions_dropped",
                                      "session_id": session_id})
            own = list(merged) or None
            taken = self.db.insert(m).values(session_id=session_id, task_id=task_id,
                                             queued_at=now, instructions=own)
            taken = taken.on_conflict_do_update(
                index_elements=[m.c.session_id],
                set_={"task_id": task_id, "queued_at": now, "instructions": own},
                where=taken_over).returning(m.c.task_id)
            row = (await conn.execute(taken)).first()
            if row is not None:
                return str(row[0])
            # A live mark: on PostgreSQL the conflict locked its row, so it is still there.
            held = (await conn.execute(sa.select(m.c.task_id, m.c.instructions)
                                       .where(m.c.session_id == session_id))).one()
            merged = merge_instructions(held.instructions or (), instructions)
            if list(merged) != list(held.instructions or ()):
                await conn.execute(m.update().where(m.c.session_id == session_id)
                                   .values(instructions=list(merged)))
        return str(held.task_id)

    async def keep_manual(self, session_id: str, instructions: Sequence[str], *,
                          task_id: str | None = None) -> bool:
        """A manual run that found the session leased (``busy``), or ended before its run row
        took its instructions (:meth:`take_manual`), hands them back: to the task queued for
        the session since it started, else to the next manual request that queues one. With
        ``task_id``, the run's own mark, when it is still there, is handed back too (the
        requests coalesced into it), in the same transaction. False when ``instructions`` would
        take the mark over ``MAX_INSTRUCTIONS`` distinct texts (they are not added)."""
        m = t.manual_requests
        async with transaction(self.engine) as conn:
            await self._session(conn, session_id)
            mine = 0
            if task_id is not None:
                # Its task ended: the next request queues a task of its own, which takes these.
                mine = (await conn.execute(
                    m.update().where(m.c.session_id == session_id, m.c.task_id == task_id)
                    .values(task_id=KEPT_TASK_ID, queued_at=KEPT_QUEUED_AT))).rowcount
            if not instructions and not mine:
                return True
            await conn.execute(self.db.insert(m).values(
                session_id=session_id, task_id=KEPT_TASK_ID, queued_at=KEPT_QUEUED_AT,
                instructions=None).on_conflict_do_nothing(index_elements=[m.c.session_id]))
            held = (await conn.execute(sa.select(m.c.instructions)
                                       .where(m.c.session_id == session_id)
                                       .with_for_update())).scalar()
            try:
                merged = merge_instructions(held or (), instructions)
            except InvalidMessage:
                return False
            await conn.execute(m.update().where(m.c.session_id == session_id)
                               .values(instructions=list(merged) or None))
        return True

    async def clear_manual(self, session_id: str, task_id: str) -> tuple[str, ...]:
        """The manual run of ``task_id`` was never sent: the next request queues. The
        instructions its requests left on the mark."""
        m = t.manual_requests
        async with transaction(self.engine) as conn:
            held = (await conn.execute(
                m.delete().where(m.c.session_id == session_id, m.c.task_id == task_id)
                .returning(m.c.instructions))).first()
        return tuple(held.instructions or ()) if held is not None else ()

    async def take_manual(self, session_id: str, task_id: str, *, run_id: str,
                          instructions: Sequence[str] = ()) -> tuple[str, ...]:
        """The manual run ``run_id`` of ``task_id`` holds the session's lease: the mark of its
        task is cleared (the next request queues a task of its own), and its run row takes
        ``instructions``, the mark's (the requests coalesced into the task) and those an
        earlier delivery of the task recorded on its row, in one transaction: a delivery that
        dies before this leaves them on the mark, one that dies after on its row, and the
        task's next delivery finds them either way. The run's instructions, distinct, in
        order, at most ``MAX_INSTRUCTIONS``."""
        m, r = t.manual_requests, t.compaction_runs
        async with transaction(self.engine) as conn:
            held = (await conn.execute(
                m.delete().where(m.c.session_id == session_id, m.c.task_id == task_id)
                .returning(m.c.instructions))).scalar()
            taken = first_instructions(instructions, held or (),
                                       await recorded_instructions(conn, task_id,
                                                                   besides_run=run_id))
            if taken:
                await conn.execute(r.update().where(r.c.id == run_id)
                                   .values(instructions=list(taken)))
        return taken

    async def note_instructions(self, run_id: str, instructions: Sequence[str]) -> None:
        """Record on the run row what a run was asked to focus on (at its start)."""
        r = t.compaction_runs
        async with transaction(self.engine) as conn:
            await conn.execute(r.update().where(r.c.id == run_id)
                               .values(instructions=list(instructions)))

    # ---------------------------------------------------------------------------------------
    # reads

    async def read_surface(self, session_id: str, *, reuse: Surface | None = None) -> Surface:
        """The surface in order, with the version it was read at, in one indexed query.

        ``reuse`` is an earlier read of the same session: its nodes still on the surface are
        kept as they are (an event never changes), and only the payloads of nodes it lacks are
        read and decoded, which is most of the cost of a read. A compaction re-reads after
        committing its prunes.
        """
        if reuse is not None and reuse.session_id == session_id and reuse.nodes:
            return await self._reread_surface(session_id, reuse)
        rows = await self.db.fetch("read_surface", session_id=session_id)
        if not rows:
            raise SessionNotFound(session_id)
        nodes = tuple(SurfaceNode(seq=r["seq"], kind=r["kind"],
                                  message=from_payload(_message_of(r["seq"], r["kind"],
                                                                   r["payload"])),
                                  tokens=r["tokens"], position=r["position"])
                      for r in rows if r["seq"] is not None)
        return Surface(session_id=session_id, version=rows[0]["surface_version"], nodes=nodes)

    async def _reread_surface(self, session_id: str, reuse: Surface) -> Surface:
        known = {node.seq: node for node in reuse.nodes}
        async with snapshot(self.engine) as conn:
            rows = (await conn.execute(_SURFACE_ROWS, {"b_id": session_id})).all()
            if not rows:
                raise SessionNotFound(session_id)
            missing = [r.seq for r in rows if r.seq is not None and r.seq not in known]
            fresh = {r.seq: r for r in await conn.execute(
                _EVENTS_BY_SEQ, {"b_id": session_id, "b_seqs": missing})} if missing else {}
        nodes: list[SurfaceNode] = []
        for r in rows:
            if r.seq is None:
                continue
            node = known.get(r.seq)
            if node is None:
                event = fresh[r.seq]
                message = from_payload(_message_of(event.seq, event.kind, event.payload))
                node = SurfaceNode(seq=r.seq, kind=event.kind, message=message, tokens=r.tokens,
                                   position=r.position)
            elif node.position != r.position or node.tokens != r.tokens:
                node = SurfaceNode(seq=node.seq, kind=node.kind, message=node.message,
                                   tokens=r.tokens, position=r.position)
            nodes.append(node)
        return Surface(session_id=session_id, version=rows[0].surface_version,
                       nodes=tuple(nodes))

    async def poll(self, session_id: str, since_version: int | None) -> int | None:
        """The surface version if it moved past ``since_version``, else None (one PK read)."""
        value = await self.db.fetchval("poll", session_id=session_id)
        if value is None:
            raise SessionNotFound(session_id)
        version = int(value)
        return None if since_version is not None and version == since_version else version

    async def recent_messages(self, session_id: str, *, limit: int) -> list[AppendedMessage]:
        """The newest ``limit`` messages the runtime appended to ``session_id``, oldest first,
        each with its append's time (replaced ones too: they were appended all the same)."""
        rows = await self.db.fetch("recent_messages", session_id=session_id, limit=limit)
        return [AppendedMessage(seq=r["seq"], at=r["created_at"], tokens=r["tokens"] or 0)
                for r in reversed(rows)]

    async def _current_version(self, session_id: str) -> int:
        version = await self.poll(session_id, None)
        assert version is not None  # poll answers the version when given nothing to compare
        return version

    async def wait_for_version(self, session_id: str, after_version: int,
                               timeout_s: float) -> int | None:
        """The session's surface version once it is past ``after_version``, waiting up to
        ``timeout_s``; None when it did not move in time. The backend's waiter waits
        (``storage.events.VersionWaiter``)."""
        return await self._waiter.wait(session_id, after_version, timeout_s,
                                       self._current_version)

    async def publish(self, event: Event) -> None:
        """Send ``event`` to the listeners now (:mod:`storage.events`)."""
        await self.db.notify(event)

    async def read_events(self, session_id: str, *, kinds: Iterable[str] | None = None,
                          after_seq: int = 0) -> list[EventRecord]:
        e = t.events.c
        stmt = (sa.select(e.seq, e.kind, e.payload, e.tokens, e.run_id, e.created_at)
                .where(e.session_id == session_id, e.seq > after_seq).order_by(e.seq))
        if kinds is not None:
            stmt = stmt.where(e.kind.in_(list(kinds)))
        async with snapshot(self.engine) as conn:
            await self._session(conn, session_id)
            return [EventRecord(seq=r.seq, kind=r.kind, payload=r.payload, tokens=r.tokens,
                                run_id=r.run_id, created_at=r.created_at)
                    for r in await conn.execute(stmt)]

    async def verify(self, session_id: str) -> VerifyResult:
        """Replay the log and compare it with the stored surface and cached totals."""
        e, s = t.events.c, t.surface.c
        async with snapshot(self.engine) as conn:
            info = await self._session(conn, session_id)
            events = [LoggedEvent(seq=r.seq, kind=r.kind, tokens=r.tokens,
                                  replaces=tuple(r.payload.get("replaces", ()))
                                  if r.kind in REPLACE_KINDS else (),
                                  before=r.payload.get("before"), after=r.payload.get("after"),
                                  keeps=tuple(r.payload.get("keeps", ())))
                      for r in await conn.execute(
                          sa.select(e.seq, e.kind, e.tokens, e.payload)
                          .where(e.session_id == session_id,
                                 e.kind.in_([NodeKind.MESSAGE, *REPLACE_KINDS]))
                          .order_by(e.seq))]
            rows = (await conn.execute(
                sa.select(s.seq, s.tokens, s.counts).where(s.session_id == session_id)
                .order_by(s.position))).all()
            stored = [(r.seq, r.tokens) for r in rows]
            last_seq = (await conn.execute(sa.select(sa.func.max(e.seq))
                                           .where(e.session_id == session_id))).scalar()
        problems: list[str] = []
        try:
            replayed = replay(events)
        except ReplayError as exc:
            replayed = []
            problems.append(f"the log does not replay: {exc}")
        if not problems and replayed != stored:
            problems.append(_first_difference(replayed, stored))
        total = sum(tok for _, tok in stored)
        if info.surface_tokens != total:
            problems.append(f"cached surface_tokens {info.surface_tokens} != sum of nodes {total}")
        if info.surface_messages != len(stored):
            problems.append(
                f"cached surface_messages {info.surface_messages} != {len(stored)} nodes")
        counted = summed(r.counts for r in rows)
        if info.counts != counted:
            problems.append(f"cached counts {info.counts} != sum of nodes {counted}")
        if (last_seq or 0) != info.last_seq:
            problems.append(f"last_seq {info.last_seq} != highest event seq {last_seq}")
        return VerifyResult(session_id=session_id, ok=not problems, problems=tuple(problems),
                            nodes=len(stored), tokens=total)

    async def all_session_ids(self) -> list[str]:
        async with connection(self.engine) as conn:
            return [r[0] for r in await conn.execute(
                sa.select(t.sessions.c.id).order_by(t.sessions.c.id))]

    async def growing_sessions(self, *, now: dt.datetime | None = None,
                               idle_windows: float = 10.0) -> list[SessionInfo]:
        """Sessions that appended within ``idle_windows`` growth windows and are growing: the
        ones with a runway to measure (an older session's rate has decayed to under a tenth
        and its runway is long). One scan of the sessions table, without an index on the
        append time, which every append would then have to update."""
        since = (now or utcnow()) - dt.timedelta(seconds=GROWTH_WINDOW_S * idle_windows)
        c = t.sessions.c
        async with connection(self.engine) as conn:
            rows = await conn.execute(sa.select(*SESSION_COLUMNS).where(
                c.growth_rate > 0, c.last_append_at >= since))
            return [session_from_row(r) for r in rows]

    async def oldest_signal(self) -> dt.datetime | None:
        """The oldest pending-signal mark (a run asked for and not yet ended) of a session still
        over its sweep threshold, None if none. A mark whose message was lost on a session that
        an overflow or manual run has since relieved is cleared by no run; it is no work
        waiting, and would otherwise age for ever. Read on the sweep's partial index."""
        c = t.sessions.c
        async with connection(self.engine) as conn:
            return (await conn.execute(sa.select(sa.func.min(c.signal_at)).where(
                t.OVER_SWEEP_THRESHOLD, c.signal_at.is_not(None)))).scalar()


# Statements of the compaction hot path, built once (building one costs about as much CPU as
# running it).
_ss, _se, _sc = t.surface.c, t.events.c, t.sessions.c
_SURFACE_ROWS = (
    sa.select(_sc.surface_version, _ss.position, _ss.seq, _ss.tokens)
    .select_from(t.sessions.outerjoin(t.surface, _ss.session_id == _sc.id))
    .where(_sc.id == sa.bindparam("b_id")).order_by(_ss.position))
_EVENTS_BY_SEQ = (sa.select(_se.seq, _se.kind, _se.payload)
                  .where(_se.session_id == sa.bindparam("b_id"),
                         _se.seq.in_(sa.bindparam("b_seqs", expanding=True))))


def _message_of(seq: int, kind: str | None, payload: Any) -> dict[str, Any]:
    if payload is None:
        raise StorageError(f"surface row seq {seq} has no event")
    return payload["message"] if kind in REPLACE_KINDS else without_reserved(payload)


def _first_difference(replayed: list[tuple[int, int]], stored: list[tuple[int, int]]) -> str:
    for i, (a, b) in enumerate(zip(replayed, stored, strict=False)):
        if a != b:
            return (f"node {i}: replay gives seq {a[0]} ({a[1]} tokens), "
                    f"stored surface has seq {b[0]} ({b[1]} tokens)")
    return (f"replay gives {len(replayed)} nodes, the stored surface has {len(stored)}")

