"""The runtime's client: a library in the agent runtime's process.

The agent never waits for a summary. At each step it appends (one round trip; the pressure
decision is taken on the totals it returns, and at most one append of a burst marks the session
and hands a run to the broker, in the background), then polls (one indexed read) and re-reads
the surface only when the version moved::

    async with CompactdClient(config) as client:
        session = await client.create_session("s1", run_model="gpt-4o", context_window=128_000,
                                              envelope={"system": SYSTEM, "tools": TOOLS})
        step = await session.append([{"role": "user", "content": "..."}])
        if await session.poll() is not None:
            messages = await session.surface()   # the newest checkpointed surface

:class:`Client` is the same API for synchronous runtimes, served by a private event loop thread.
On a provider context-overflow error, :meth:`SessionHandle.report_overflow` forces a compaction
on ``compaction.urgent`` and returns the smaller surface, or says promptly that nothing can be
compacted so the runtime can raise the provider's original error.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from compactd.scheduler.args import parse_keep
from compactd.scheduler.intake import SignalResult, accept_signal, parse_signal
from compactd.storage.deletion import DeletionResult
from compactd.storage.errors import (
    CompactdError,
    CompactionRefused,
    InvalidMessage,
    SessionNotFound,
)
from compactd.storage.events import Event, EventKind
from compactd.storage.ids import (
    check_count,
    check_id,
    check_seconds,
    check_session_id,
    check_tenant,
)
from compactd.storage.instructions import check_instructions
from compactd.storage.kinds import FailureClass, RunCause, RunStatus, SignalReason
from compactd.storage.messages import Message, check_json, check_message, parse
from compactd.storage.migrate import open_schema
from compactd.storage.recall import DEFAULT_READ_TOKENS, ReadPage, SearchResult
from compactd.storage.recall_bounds import DEFAULT_SEARCH_LIMIT
from compactd.storage.records import AppendResult, RunRecord, SessionInfo, utcnow
from compactd.storage.store import PreparedAppend, Store
from compactd.storage.tokens import counter_for
from compactd.worker.compaction.planner import plan
from compactd.worker.compaction.policy import Clause
from compactd.worker.compaction.recall import parse_ref
from compactd.worker.compaction.render import render_surface
from compactd.worker.cost import Price, usage_cost
from compactd.worker.enqueue import Enqueuer, RunRequest, enqueue_manual, enqueue_marked
from compactd.worker.pressure import (
    check_session_policy,
    session_policy,
    wants_run,
    window_fit,
    window_for,
)
from compactd.worker.runtime import EventLoopThread
from compactd.worker.settings import Config, load_config

WAIT_POLL_S = 0.05
# A signal's send starts this long after the append that set the mark: the publish runs in a
# thread, and while it holds the GIL the step's poll that follows the append waited for it
# (docs/benchmarks.md, "The agent's hot path"). A compaction takes seconds; 20 ms later is the
# same to it.
SIGNAL_SEND_DELAY_S = 0.02
# An append with an idempotency key is made this many times at most when the database
# connection fails under it (a failover takes seconds: the waits double from APPEND_RETRY_S).
APPEND_ATTEMPTS = 4
APPEND_RETRY_S = 0.25
# After a send the broker refused, the signals of the next this-many seconds are not sent (their
# marks are freed, as a failed send's is): while Redis is down each append over its trigger
# would otherwise hold a thread of the loop's default executor on a send bound to fail, and
# those queue without bound in a busy runtime (recall's reads wait behind them). The pressure
# sweep enqueues the sessions once Redis is back.
BROKER_HOLD_S = 5.0

logger = logging.getLogger(__name__)


# ``SessionHandle.report_usage``'s default: the call was built on the handle's own view.
OWN_VIEW: Any = object()

class WaitTimeout(CompactdError):
    """The compaction did not finish within the timeout (it may still run)."""


@dataclass(frozen=True, slots=True)
class StepResult:
    """What an append did."""

    version: int
    first_seq: int
    last_seq: int
    tokens: int  # surface tokens after the append
    messages: int  # surface nodes after the append
    fired: bool  # the trigger fires on the new totals
    # This append marked the session and handed a compaction to the broker (at most one per
    # burst). The send runs in the background: a failed one clears the mark and is logged, and
    # the pressure sweep finds the session anyway.
    signalled: bool
    # The append was made earlier with this idempotency key: this is what it returned (its
    # version, seqs and totals), and nothing was stored now.
    replayed: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"version": self.version, "first_seq": self.first_seq,
                "last_seq": self.last_seq, "tokens": self.tokens, "messages": self.messages,
                "fired": self.fired, "signalled": self.signalled, "replayed": self.replayed}


@dataclass(frozen=True, slots=True)
class OverflowResult:
    compacted: bool
    reason: str
    version: int
    messages: list[dict[str, Any]] | None = None
    run: dict[str, Any] | None = None
    pruned: int = 0  # tool results pruned by the run, committed even when it failed after
    tokens_after: int | None = None  # the session's pressure after what the run committed

    def to_json(self) -> dict[str, Any]:
        return {"compacted": self.compacted, "reason": self.reason, "version": self.version,
                "messages": self.messages, "run": self.run, "pruned": self.pruned,
                "tokens_after": self.tokens_after}


def parse_messages(raw: Iterable[Mapping[str, Any] | Message], fmt: str = "openai"
                   ) -> list[Message]:
    """Messages from dicts in a wire format (or already parsed); errors name the index."""
    out: list[Message] = []
    for index, item in enumerate(raw):
        try:
            if isinstance(item, Message):
                out.append(check_message(item))
            else:
                out.extend(parse(item, fmt))
        except InvalidMessage as exc:
            raise InvalidMessage(exc.reason, index=index, field=exc.field) from None
    return out


def check_policy(overrides: Mapping[str, Any] | None, config: Config, *,
                 run_model: str | None = None, context_window: int | None = None) -> None:
    """Refuse bad per-session overrides when the session is created, not at its first run,
    and a keep that the session's window would make fire the trigger again."""
    check_session_policy(dict(overrides) if overrides is not None else None, config,
                         run_model=run_model, context_window=context_window)


class CompactdClient:
    """Async client; one per runtime process (it owns a connection pool)."""

    def __init__(self, config: Config | None = None, *, store: Store | None = None,
                 enqueuer: Enqueuer | None = None) -> None:
        self.config = config or load_config()
        self.store = store or Store.from_url(
            self.config.database_url, pool_size=5,
            statement_cache=self.config.database.statement_cache)
        self._own_store = store is None
        if enqueuer is None:
            # Imported here: a runtime that passes its own enqueuer never loads Celery.
            from compactd.worker.app import client_app

            enqueuer = Enqueuer(client_app(self.config))
        self.enqueuer = enqueuer
        self._schema_checked = False
        self._sending: set[asyncio.Task[None]] = set()
        # When a send last failed (loop time), and the signals not sent since.
        self._broker_failed_at: float | None = None
        self._probing = False
        self._held_signals = 0

    async def __aenter__(self) -> CompactdClient:
        await self._ensure_schema()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        try:
            await self.drain()
        finally:
            if self._own_store:
                await self.store.close()

    async def drain(self) -> None:
        """Wait until every signal this client is sending in the background has reached the
        broker or been given up (closing the client does this first)."""
        while self._sending:
            await asyncio.gather(*self._sending, return_exceptions=True)

    def send_in_background(self, request: RunRequest) -> None:
        """Hand the run for a session whose signal mark was just set to the broker without
        making the caller wait: a publish costs the step more than the append itself, and the
        signal is only a hint. The send starts ``SIGNAL_SEND_DELAY_S`` later,
        after the step's poll in practice."""
        task = asyncio.get_running_loop().create_task(self._send_marked(request))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    def _broker_held(self) -> bool:
        """Whether a send now is held back: within the hold after a refused send, or while the
        one send that tries the broker again after it is under way."""
        failed = self._broker_failed_at
        if failed is None:
            return False
        return self._probing or asyncio.get_running_loop().time() - failed < BROKER_HOLD_S

    async def _send_marked(self, request: RunRequest) -> None:
        probe = False
        try:
            await asyncio.sleep(SIGNAL_SEND_DELAY_S)
            if self._broker_held():
                self._held_signals += 1
                await self.store.clear_signal(request.session_id)
                return
            probe = self._probing = self._broker_failed_at is not None
            await enqueue_marked(self.store, self.enqueuer, request)
            self._broker_failed_at = None
        except asyncio.CancelledError:
            # Cancelled before the broker had it (the loop is closing without aclose): free the
            # mark, or the session's next signal waits for its TTL or the pressure sweep.
            with contextlib.suppress(Exception):
                await asyncio.shield(self.store.clear_signal(request.session_id))
            raise
        except Exception as exc:
            # The messages are committed; a lost signal costs nothing lasting (enqueue_marked
            # frees the mark so the next append signals again, and the pressure sweep finds it).
            self._broker_failed_at = asyncio.get_running_loop().time()
            held, self._held_signals = self._held_signals, 0
            logger.warning("an append's signal was not enqueued: %s (signals held back since "
                           "the last failure: %d; the next %.0f s are held back too)", exc,
                           held, BROKER_HOLD_S,
                           extra={"action": "signal_failed", "session_id": request.session_id,
                                  "held": held})
        finally:
            if probe:
                self._probing = False

    async def _ensure_schema(self) -> None:
        if not self._schema_checked:
            await open_schema(self.store.engine, self.config.database_url)
            self._schema_checked = True

    async def create_session(self, session_id: str, *, run_model: str | None = None,
                             context_window: int | None = None,
                             envelope: Mapping[str, Any] | None = None,
                             tenant: str = "default",
                             policy: Mapping[str, Any] | None = None) -> SessionHandle:
        """Create the session, or open it when it exists with the same tenant and run model."""
        check_session_id(session_id)
        check_tenant(tenant)
        await self._ensure_schema()
        check_json(envelope, "envelope")
        check_json(policy, "policy")
        if context_window is not None:
            check_count(context_window, "context_window", minimum=1)
        # Reopening keeps the stored overrides and window unless new ones are given: judge those.
        stored: SessionInfo | None = None
        if policy is None or context_window is None:
            with contextlib.suppress(SessionNotFound):
                stored = await self.store.get_session(session_id)
        check_policy(policy if policy is not None or stored is None else stored.policy,
                     self.config, run_model=run_model,
                     context_window=context_window or (stored.context_window if stored else None))
        info, created = await self.store.open_session(
            session_id, tenant=tenant, run_model=run_model,
            context_window=context_window or self.config.context_window(run_model),
            envelope=dict(envelope) if envelope is not None else None,
            policy=dict(policy) if policy is not None else None)
        await _warm_counter(info.run_model)
        return SessionHandle(self, info, created=created)

    async def delete(self, session_id: str, *, tenant: str | None = None) -> DeletionResult:
        """Delete the session and every row of it: its log, surface, recall index, runs,
        journal, queued manual request and pending signal. A run in flight ends ``cancelled``
        and commits nothing. With ``tenant``, another tenant's session is not found and nothing
        is deleted. SessionNotFound when there is no such session."""
        check_session_id(session_id)
        if tenant is not None:
            check_tenant(tenant)
        await self._ensure_schema()
        return await self.store.delete_session(session_id, tenant=tenant)

    async def get_session(self, session_id: str) -> SessionHandle:
        check_session_id(session_id)
        await self._ensure_schema()
        info = await self.store.get_session(session_id)
        await _warm_counter(info.run_model)
        return SessionHandle(self, info)


async def _warm_counter(run_model: str | None) -> None:
    """Load the run model's tokenizer now (a BPE file parsed, once per process), in a
    thread: otherwise the agent's first step pays for it."""
    # The counter is made in the thread too: making it is what loads the file.
    await asyncio.to_thread(lambda: counter_for(run_model).count_text("warm"))


class SessionHandle:
    """One session, as a runtime drives it."""

    def __init__(self, client: CompactdClient, info: SessionInfo, *,
                 created: bool = False) -> None:
        self.client = client
        self.info = info
        # Whether create_session created it (False when it opened an existing one).
        self.created = created
        self.version = info.surface_version

    @property
    def id(self) -> str:
        return self.info.id

    @property
    def _config(self) -> Config:
        return self.client.config

    def _wants_signal(self, info: SessionInfo) -> bool:
        cooling = info.cooldown_until is not None and info.cooldown_until > utcnow()
        return not cooling and wants_run(info, self._config)

    async def append(self, messages: Sequence[Mapping[str, Any] | Message] | PreparedAppend, *,
                     format: str = "openai", idempotency_key: str | None = None,
                     retry: bool = False) -> StepResult:
        """Append one step's messages; when the trigger fires, one compaction is enqueued
        (the first append of a burst does it, the others see it pending). A batch already
        parsed and prepared (``storage.store.prepare_append``) is stored as it is.

        ``idempotency_key``: the same key with the same messages, within
        ``retention.append_keys_hours``, returns the first append's result and stores nothing
        (``StepResult.replayed``); with other messages it is refused
        (:class:`~compactd.storage.errors.IdempotencyKeyReused`). ``retry``: use a new key
        (a uuid4) when none is given. With a key, an append the database connection failed
        under (it may have committed) is made again, up to ``APPEND_ATTEMPTS`` times; without
        one it is not, since a second append could store the step twice."""
        parsed = messages if isinstance(messages, PreparedAppend) else \
            parse_messages(messages, format)
        if idempotency_key is None and retry:
            idempotency_key = uuid.uuid4().hex
        result = await self._append(parsed, idempotency_key)
        if not result.replayed:
            self.info = result.session
        if result.version == self.version + 1:
            # Only this append moved the version: the runtime has these messages already, so the
            # next poll must report a compaction's commit, not our own append.
            self.version = result.version
        if result.signalled:
            self.client.send_in_background(RunRequest(self.id, RunCause.PRESSURE))
        fired = result.signalled or wants_run(result.session, self._config)
        return StepResult(version=result.version, first_seq=result.first_seq,
                          last_seq=result.last_seq, tokens=result.session.surface_tokens,
                          messages=result.session.surface_messages, fired=fired,
                          signalled=result.signalled, replayed=result.replayed)

    async def _append(self, parsed: Sequence[Message] | PreparedAppend,
                      key: str | None) -> AppendResult:
        store, config = self.client.store, self._config
        for attempt in range(1, APPEND_ATTEMPTS + 1):
            try:
                return await store.append(
                    self.id, parsed, signal_if=self._wants_signal,
                    signal_ttl_s=config.worker.signal_ttl_s, idempotency_key=key,
                    key_window_s=config.retention.append_key_window_s)
            except CompactdError as exc:
                if key is None or not exc.retryable or attempt == APPEND_ATTEMPTS:
                    raise
                logger.warning("append failed (%s); retrying with its idempotency key", exc,
                               extra={"action": "append_retry", "session_id": self.id,
                                      "attempt": attempt})
                await asyncio.sleep(APPEND_RETRY_S * 2 ** (attempt - 1))
        raise AssertionError("unreachable")

    async def signal(self, reason: str = SignalReason.PRESSURE) -> SignalResult:
        payload = parse_signal({"session": self.id, "reason": reason})
        return await accept_signal(self.client.store, self._config, self.client.enqueuer,
                                   payload)

    async def report_usage(self, input_tokens: int, output_tokens: int = 0, *,
                           response_appended: bool = True,
                           surface_version: int | None = OWN_VIEW) -> SessionInfo:
        """The provider's own usage for the runtime's last call. Pressure then counts its input,
        its output and what is appended after the response; pass ``response_appended=False``
        when reporting before appending the response, so that it is not counted twice.

        ``surface_version``: the surface the call was built on; by default the one this handle
        last read, with its own appends since (None: not known, the report is recorded as it
        is). Appends after it (the reply, another writer's) are counted on top. A report built
        before a compaction committed describes a request larger than the next one, and the
        store does not record it."""
        built_on = self.version if surface_version is OWN_VIEW else surface_version
        self.info = await self.client.store.report_usage(
            self.id, input_tokens, output_tokens, response_appended=response_appended,
            surface_version=built_on)
        # The row the report returned shows a live mark as well as mark_signal would find it:
        # a run is already asked for, and the agent's step is spared the round trips.
        ttl_s = self._config.worker.signal_ttl_s
        if self._wants_signal(self.info) and not self.info.signal_live(utcnow(), ttl_s) \
                and await self.client.store.mark_signal(self.id, ttl_s=ttl_s):
            self.client.send_in_background(RunRequest(self.id, RunCause.PRESSURE))
        return self.info

    async def poll(self, since_version: int | None = None) -> int | None:
        """The new surface version if it moved since ``since_version`` (default: the version
        this handle last read or appended at), else None. One primary-key read."""
        since = self.version if since_version is None else since_version
        moved = await self.client.store.poll(self.id, since)
        return moved

    async def wait_for_checkpoint(self, after_version: int | None = None,
                                  timeout_s: float = 30.0) -> int | None:
        """Wait until a compaction commits past ``after_version`` (default: the version this
        handle last read or appended at) and return the new surface version; None when none
        committed within ``timeout_s`` seconds. On PostgreSQL this is a LISTEN, not polling: it
        returns as the commit's notification arrives. :meth:`surface` then reads the
        checkpoint."""
        check_seconds(timeout_s, "timeout_s")
        since = self.version if after_version is None else after_version
        return await self.client.store.wait_for_version(self.id, since, timeout_s)

    async def surface(self, render: str | None = None, *,
                      contract: bool = True) -> list[dict[str, Any]]:
        """The messages the model should see now, checkpoints rendered. A ``durable_context``
        checkpoint's authority contract joins the leading system message, or opens the data
        message when the surface has none (the runtime's own system prompt goes first);
        ``contract=False`` leaves it out, for a runtime that adds it to its own system prompt
        (:data:`worker.compaction.render.AUTHORITY_CONTRACT`)."""
        surface = await self.client.store.read_surface(self.id)
        self.version = surface.version
        return render_surface(surface.nodes, render, contract=contract)

    async def history_search(self, query: str, checkpoint: str | None = None,
                             limit: int = DEFAULT_SEARCH_LIMIT) -> SearchResult:
        """The messages compaction replaced in this session that hold ``query`` (exact hits
        first), within one checkpoint's originals when ``checkpoint`` names it."""
        # A name that is not one (a typo) is refused by name, as over HTTP; storage would only
        # say it has no such node.
        ref = None if checkpoint is None else str(parse_ref(checkpoint))
        return await self.client.store.history_search(self.id, query, ref, limit,
                                                      tenant=self.info.tenant)

    async def history_read(self, checkpoint: str, offset: int | str = 0, *,
                           cursor: str | None = None,
                           budget_tokens: int = DEFAULT_READ_TOKENS) -> ReadPage:
        """A page of the originals ``checkpoint`` replaced, from ``offset`` (a message index
        or the cursor the previous page returned) or ``cursor``, at most ``budget_tokens``
        (64-100,000) long."""
        return await self.client.store.history_read(self.id, str(parse_ref(checkpoint)), offset,
                                                    cursor=cursor, budget_tokens=budget_tokens,
                                                    tenant=self.info.tenant)

    async def compact(self, *, force: bool = False, keep: str | Clause | None = None,
                      wait: bool = True, timeout_s: float = 120.0,
                      instructions: str | None = None) -> dict[str, Any]:
        """A manual compaction on ``compaction.urgent``; with ``wait``, its run's result.
        ``keep`` (``messages:12`` or a clause) and ``instructions`` (what the summary should
        focus on, at most ``storage.instructions.MAX_INSTRUCTION_CHARS`` characters) are
        checked here, before anything is queued. While one for the session is queued and not
        started, this is that one (``coalesced``), and it takes these instructions too."""
        check_seconds(timeout_s, "timeout_s")
        clause = parse_keep(keep, "keep")
        focus = () if instructions is None else (check_instructions(instructions),)
        queued = await enqueue_manual(
            self.client.store, self.client.enqueuer,
            RunRequest(self.id, RunCause.MANUAL, force=force,
                       keep=None if clause is None else clause.to_text(), instructions=focus),
            ttl_s=self._config.worker.signal_ttl_s)
        if not wait:
            return {"session": self.id, "outcome": "queued", "task_id": queued.task_id,
                    "coalesced": queued.coalesced}
        run = await self.wait_for_run(queued.task_id, timeout_s)
        return run_result(run, self._config.prices)

    async def compact_context(self, focus: str) -> dict[str, Any]:
        """The agent's own request for a compaction (the ``compact_context`` tool): a manual
        run on ``compaction.urgent`` whose instructions are the agent's handoff note
        ``focus``, queued and never waited for; the agent's next step picks up its checkpoint
        as any other. Refused (:class:`CompactionRefused`) while the loop guard cools the
        session down, or once the session had ``worker.loop_guard.max_compactions`` manual
        runs within ``window_s`` (not counting those that found it busy): an agent that calls
        it every step gets that answer, not a run per step."""
        text = check_instructions(focus, "focus")
        await self._check_agent_guard()
        queued = await enqueue_manual(
            self.client.store, self.client.enqueuer,
            RunRequest(self.id, RunCause.MANUAL, instructions=(text,)),
            ttl_s=self._config.worker.signal_ttl_s)
        return {"session": self.id, "outcome": "queued", "task_id": queued.task_id,
                "coalesced": queued.coalesced}

    async def _check_agent_guard(self) -> None:
        store, guard = self.client.store, self._config.worker.loop_guard
        now = utcnow()
        info = await store.get_session(self.id)
        if info.cooldown_until is not None and info.cooldown_until > now:
            raise CompactionRefused(
                f"compact_context refused: the loop guard cools this session down until "
                f"{info.cooldown_until.isoformat(timespec='seconds')} "
                f"({info.flagged_reason or 'compacting without relief'})")
        since = now - dt.timedelta(seconds=guard.window_s)
        # Only manual runs: the session's automatic runs in the window, however many, must not
        # push the agent's own out of a limited read. Only those that held the lease: one that
        # found the session busy compacted nothing (its instructions wait for the next).
        asked = len(await store.recent_runs(session_id=self.id, since=since,
                                            trigger=RunCause.MANUAL, leased=True,
                                            limit=guard.max_compactions))
        if asked >= guard.max_compactions:
            raise CompactionRefused(
                f"compact_context refused: this session was compacted on request {asked} "
                f"times in the last {guard.window_s:g} s (the loop guard allows "
                f"{guard.max_compactions}); go on with the task: compactd compacts the "
                "context in the background when it needs it")

    async def set_run_model(self, name: str, context_window: int | None = None
                            ) -> dict[str, Any]:
        """The agent moved to run model ``name`` (its window ``context_window``, else the
        configured or published one). When the session as it stands does not fit the new
        window with its reserve (what its trigger keeps free there), it is compacted at once
        on ``compaction.urgent`` (``task_id``; :meth:`wait_for_run` waits for it), keeping the
        newest messages up to the policy's retain ratio of the window. Checked before anything
        changes: a policy the new window refuses is a ConfigError naming it."""
        check_id(name, field="run_model", what="a run model")
        if context_window is not None:
            check_count(context_window, "context_window", minimum=1)
        config, store = self._config, self.client.store
        window = window_for(config, name, context_window)
        info = await store.get_session(self.id)
        check_policy(info.policy, config, run_model=name, context_window=window)
        fit = None if window is None else window_fit(info, config, run_model=name,
                                                     window=window)
        # Before the row is locked, and in a thread: the store counts the envelope with the
        # new model's tokenizer under the session's lock, on this loop.
        await _warm_counter(name)
        self.info = await store.set_run_model(self.id, name, window)
        result: dict[str, Any] = {"session": self.id, "run_model": name,
                                  "context_window": window,
                                  "fit": None if fit is None else fit.to_json(),
                                  "compacting": False, "task_id": None}
        if fit is not None and not fit.fits:
            # Not coalesced with a queued manual run: this one keeps what fits the window. Nor
            # a manual run: the loop guard's count of the agent's own requests leaves it out.
            result["task_id"] = await self.client.enqueuer.asend(RunRequest(
                self.id, RunCause.WINDOW, keep=f"tokens:{fit.keep_tokens}"))
            result["compacting"] = True
        return result

    async def delete(self) -> DeletionResult:
        """Delete this session and every row of it (:meth:`CompactdClient.delete`)."""
        return await self.client.delete(self.id, tenant=self.info.tenant)

    async def report_overflow(self, *, wait: bool = True, timeout_s: float = 60.0
                              ) -> OverflowResult:
        """The provider said the context overflowed: force a compaction now.

        The forced plan is computed here first (pure, milliseconds); when even a forced run could
        not shrink the surface (one indivisible tool group), the answer comes at once.
        """
        check_seconds(timeout_s, "timeout_s")
        store = self.client.store
        info = await store.get_session(self.id)
        surface = await store.read_surface(self.id)
        policy = session_policy(info, self._config)
        forced = plan(surface.nodes, policy=policy, envelope_tokens=info.envelope_tokens,
                      reported_input_tokens=info.reported_input_tokens,
                      run_model=info.run_model, now=utcnow(), force=True,
                      envelope=info.envelope)
        if not forced.compacts and not forced.prune:
            return OverflowResult(False, f"nothing to compact: {forced.nothing_to_do}",
                                  surface.version)
        start_version = surface.version
        task_id = await self.client.enqueuer.asend(
            RunRequest(self.id, RunCause.OVERFLOW, force=True))
        if not wait:
            return OverflowResult(False, "queued", start_version, run={"task_id": task_id})
        run = await self.wait_for_run(task_id, timeout_s, retry_busy=True)
        result = run_result(run, self._config.prices)
        failed = f"{result['outcome']}" + (
            f" ({result['failure_class']})" if result["failure_class"] else "") + (
            f": {result.get('error') or ''}".rstrip(": "))
        if result["outcome"] == RunStatus.COMMITTED or result["stages"]:
            # A failed run may still have committed (its prunes, an earlier round's summary):
            # that smaller surface is the answer, and the runtime retries with it.
            reason = "compacted" if result["outcome"] == RunStatus.COMMITTED else (
                f"compacted in part ({', '.join(result['stages'])}); then {failed}")
            messages = await self.surface()
            await self._served_overflow(Event(
                EventKind.OVERFLOW_SERVED, self.id, self.info.tenant, result["run_id"],
                self.version, None, result["outcome"]))
            return OverflowResult(True, reason, self.version, messages=messages, run=result,
                                  pruned=result["pruned"],
                                  tokens_after=result["tokens_after"])
        return OverflowResult(False, failed, start_version, run=result)

    async def _served_overflow(self, event: Event) -> None:
        """Tell the listeners and the webhooks that this overflow was served; the runtime has
        its smaller surface whatever becomes of the event."""
        # Imported here for start-up time: the webhooks bring the worker's run and metrics
        # modules, which a CLI command or a runtime without webhooks never uses.
        from compactd.worker.webhooks import send_event

        try:
            await self.client.store.publish(event)
            if self._config.events.webhooks:
                await asyncio.to_thread(send_event, self.client.enqueuer.app, self._config,
                                        event)
        except Exception as exc:
            logger.warning("session.overflow_served was not sent: %s", exc,
                           extra={"action": "events.not_sent", "session_id": self.id})

    async def wait_for_run(self, task_id: str, timeout_s: float, *,
                            retry_busy: bool = False) -> RunRecord:
        """Wait for the run of ``task_id`` to end (its row in PostgreSQL is the result).

        With ``retry_busy``, a run that found the session leased (a pressure run in progress)
        waits for that lease to end and tries once more under the same deadline.
        """
        store = self.client.store
        deadline = asyncio.get_running_loop().time() + timeout_s
        retried = False
        while True:
            runs = [r for r in await store.runs_for_task(task_id) if r.finished]
            if runs:
                run = runs[-1]
                if not (retry_busy and not retried and run.failure_class == FailureClass.BUSY):
                    return run
                retried = True
                while (await store.get_session(self.id)).lease_run_id is not None:
                    if asyncio.get_running_loop().time() >= deadline:
                        raise WaitTimeout(f"session {self.id!r} stayed leased")
                    await asyncio.sleep(WAIT_POLL_S)
                task_id = await self.client.enqueuer.asend(
                    RunRequest(self.id, RunCause.OVERFLOW, force=True))
            if asyncio.get_running_loop().time() >= deadline:
                raise WaitTimeout(f"no result for task {task_id} within {timeout_s:g} s "
                                  "(is a worker running?)")
            await asyncio.sleep(WAIT_POLL_S)


def run_result(run: RunRecord, prices: Mapping[str, Price]) -> dict[str, Any]:
    """A run row in the shape of ``compact --json``, its cost at ``prices``."""
    stages = (run.stages or {}).get("stages", []) if run.stages else []
    return {"session": run.session_id, "run_id": run.id, "outcome": run.status,
            "failure_class": run.failure_class, "tokens_before": run.tokens_before,
            "tokens_after": run.tokens_after, "pruned": (run.stages or {}).get("pruned", 0),
            "replaced_seqs": run.range_seqs or [], "model": run.model, "usage": run.usage,
            "cost": usage_cost(run.usage, prices), "stages": stages,
            "error": run.error, "candidates": run.candidates or [],
            "instructions": run.instructions or [],
            "started_at": run.started_at.isoformat(),
            "finished_at": run.finished_at.isoformat() if run.finished_at else None}


class Client:
    """The synchronous client: the same calls, served by a private event loop thread.

    The loop thread is compactd's own (``worker.runtime.EventLoopThread``), not anyio's blocking
    portal: the portal hands every call between the two threads twice, and was measured slower
    per call (``tests/bench/sync_dispatch.py``; figures in docs/benchmarks.md)."""

    def __init__(self, config: Config | None = None) -> None:
        self._loop = EventLoopThread(name="compactd-client")
        self._async = self._loop.submit(lambda: _open(config))

    def close(self) -> None:
        self._loop.submit(self._async.aclose)
        self._loop.stop()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def create_session(self, session_id: str, **kwargs: Any) -> SyncSession:
        handle = self._loop.submit(lambda: self._async.create_session(session_id, **kwargs))
        return SyncSession(self._loop, handle)

    def get_session(self, session_id: str) -> SyncSession:
        handle = self._loop.submit(lambda: self._async.get_session(session_id))
        return SyncSession(self._loop, handle)

    def delete(self, session_id: str, *, tenant: str | None = None) -> DeletionResult:
        return self._loop.submit(lambda: self._async.delete(session_id, tenant=tenant))


async def _open(config: Config | None) -> CompactdClient:
    client = CompactdClient(config)
    await client._ensure_schema()
    return client


class SyncSession:
    def __init__(self, loop: EventLoopThread, handle: SessionHandle) -> None:
        self._loop = loop
        self.handle = handle

    @property
    def id(self) -> str:
        return self.handle.id

    def append(self, messages: Sequence[Mapping[str, Any] | Message], **kw: Any) -> StepResult:
        return self._loop.submit(lambda: self.handle.append(messages, **kw))

    def signal(self, reason: str = SignalReason.PRESSURE) -> SignalResult:
        return self._loop.submit(lambda: self.handle.signal(reason))

    def report_usage(self, input_tokens: int, output_tokens: int = 0, *,
                     response_appended: bool = True) -> SessionInfo:
        return self._loop.submit(lambda: self.handle.report_usage(
            input_tokens, output_tokens, response_appended=response_appended))

    def poll(self, since_version: int | None = None) -> int | None:
        return self._loop.submit(lambda: self.handle.poll(since_version))

    def wait_for_checkpoint(self, after_version: int | None = None,
                            timeout_s: float = 30.0) -> int | None:
        return self._loop.submit(lambda: self.handle.wait_for_checkpoint(after_version,
                                                                         timeout_s))

    def surface(self, render: str | None = None, *,
                contract: bool = True) -> list[dict[str, Any]]:
        return self._loop.submit(lambda: self.handle.surface(render, contract=contract))

    def history_search(self, query: str, checkpoint: str | None = None,
                       limit: int = DEFAULT_SEARCH_LIMIT) -> SearchResult:
        return self._loop.submit(lambda: self.handle.history_search(query, checkpoint, limit))

    def history_read(self, checkpoint: str, offset: int | str = 0, *,
                     cursor: str | None = None,
                     budget_tokens: int = DEFAULT_READ_TOKENS) -> ReadPage:
        return self._loop.submit(lambda: self.handle.history_read(
            checkpoint, offset, cursor=cursor, budget_tokens=budget_tokens))

    def compact(self, **kw: Any) -> dict[str, Any]:
        return self._loop.submit(lambda: self.handle.compact(**kw))

    def compact_context(self, focus: str) -> dict[str, Any]:
        return self._loop.submit(lambda: self.handle.compact_context(focus))

    def set_run_model(self, name: str, context_window: int | None = None) -> dict[str, Any]:
        return self._loop.submit(lambda: self.handle.set_run_model(name, context_window))

    def report_overflow(self, **kw: Any) -> OverflowResult:
        return self._loop.submit(lambda: self.handle.report_overflow(**kw))


