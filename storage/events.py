"""Events: what compactd tells a runtime and an operator without being asked.

Three kinds, each a small JSON object (``event``, ``session``, ``tenant``, ``run_id``,
``version``, ``seq``, ``outcome``):

- ``compaction.committed``: a run's commit moved the surface (``version`` is the new surface
  version; ``outcome`` is the run's, or ``running`` while later rounds may follow);
- ``compaction.failed``: a run ended failed (``outcome`` is its failure class);
- ``session.overflow_served``: the runtime reported a context overflow and got a smaller surface.

On PostgreSQL each is sent with ``pg_notify`` on the channel :data:`CHANNEL` in the transaction
that makes it true (the commit's own statement, the failed run's end), so a listener hears of
nothing that was rolled back and never before the change is visible. :class:`Listener` holds one
connection in ``LISTEN`` and wakes whoever waits for a session. SQLite has no notifications: a
waiter there (:class:`VersionPoller`) reads the session's version every ``POLL_S`` (the
embedded default's worker is another process, which no in-process signal reaches). Each
backend's connector gives its own :class:`VersionWaiter` (``Connector.waiter``).
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import StrEnum, unique
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from compactd.storage.database import translated
from compactd.storage.kinds import FailureClass, RunStatus

CHANNEL = "compactd_events"
# How often a waiter on SQLite reads the session's version.
POLL_S = 0.05

logger = logging.getLogger(__name__)


@unique
class EventKind(StrEnum):
    COMMITTED = "compaction.committed"
    FAILED = "compaction.failed"
    OVERFLOW_SERVED = "session.overflow_served"


@dataclass(frozen=True, slots=True)
class Event:
    event: str
    session: str
    tenant: str
    run_id: str | None
    version: int
    seq: int | None = None
    outcome: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"event": self.event, "session": self.session, "tenant": self.tenant,
                "run_id": self.run_id, "version": self.version, "seq": self.seq,
                "outcome": self.outcome}

    def dumps(self) -> str:
        return json.dumps(self.to_json(), separators=(",", ":"))


def run_end_kind(status: str, failure_class: str | None) -> EventKind | None:
    """The event a run's end is: ``compaction.committed`` or ``compaction.failed`` (a run that
    found the session leased by another is contention, not an event); None for the others."""
    if status == RunStatus.COMMITTED:
        return EventKind.COMMITTED
    if status in (RunStatus.FAILED, RunStatus.PARTIAL) and failure_class != FailureClass.BUSY:
        return EventKind.FAILED
    return None


def run_end_event(session: str, tenant: str, run_id: str, *, version: int, seq: int | None,
                  status: str, failure_class: str | None) -> Event | None:
    """The event of :func:`run_end_kind`: its ``outcome`` is the run's status when it
    committed, its failure class when it failed."""
    kind = run_end_kind(status, failure_class)
    if kind is None:
        return None
    if kind == EventKind.COMMITTED:
        return commit_event(session, tenant, run_id, version=version, seq=seq, outcome=status)
    return Event(kind, session, tenant, run_id, version, seq, str(failure_class or status))


def commit_event(session: str, tenant: str, run_id: str, *, version: int, seq: int | None,
                 outcome: str) -> Event:
    """A commit's event: ``outcome`` is the run's status when the commit ends the run,
    ``running`` while later rounds may follow."""
    return Event(EventKind.COMMITTED, session, tenant, run_id, version, seq, outcome)


# The fields of a commit's event that only the commit knows: its statement on PostgreSQL
# (queries.sql's ``commit`` and ``commit_ending``) adds them to :func:`commit_event_fields`
# from the session row it returns (tenant, surface_version, last_seq) and sends the event.
COMMIT_ROW_FIELDS = ("tenant", "version", "seq")


def commit_event_fields(session: str, run_id: str, outcome: str) -> str:
    """A commit's event as JSON, without :data:`COMMIT_ROW_FIELDS`: the rest is built here
    whatever the statement adds, so the event the commit sends is :func:`commit_event`'s."""
    event = commit_event(session, "", run_id, version=0, seq=None, outcome=outcome)
    return json.dumps({k: v for k, v in event.to_json().items() if k not in COMMIT_ROW_FIELDS},
                      separators=(",", ":"))


def parse_event(text: str) -> Event | None:
    """The event a notification carries; None (logged) for one that is not compactd's."""
    try:
        raw = json.loads(text)
        return Event(event=str(raw["event"]), session=str(raw["session"]),
                     tenant=str(raw["tenant"]), run_id=raw.get("run_id"),
                     version=int(raw["version"]), seq=raw.get("seq"),
                     outcome=raw.get("outcome"))
    except (ValueError, KeyError, TypeError):
        logger.warning("a notification on %s is not an event: %.200s", CHANNEL, text)
        return None


class VersionWaiter(abc.ABC):
    """How a process waits for a session's surface version to move past one it has seen
    (``Store.wait_for_version``)."""

    @abc.abstractmethod
    async def wait(self, session_id: str, after_version: int, timeout_s: float,
                   read_version: Callable[[str], Awaitable[int]]) -> int | None:
        """The session's version once it is past ``after_version``, None when it did not move
        within ``timeout_s``; ``read_version`` reads it (SessionNotFound for a session that is
        not there)."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Give back what the waiter holds."""


class VersionPoller(VersionWaiter):
    """A waiter that reads the version every :data:`POLL_S` (SQLite, which has no
    notifications)."""

    async def wait(self, session_id: str, after_version: int, timeout_s: float,
                   read_version: Callable[[str], Awaitable[int]]) -> int | None:
        loop = asyncio.get_running_loop()
        until = loop.time() + timeout_s
        while True:
            version = await read_version(session_id)
            if version > after_version:
                return version
            if loop.time() >= until:
                return None
            await asyncio.sleep(min(POLL_S, max(0.0, until - loop.time())))

    async def close(self) -> None:
        # It holds nothing between waits.
        return None


class Listener(VersionWaiter):
    """One PostgreSQL connection in ``LISTEN compactd_events``, shared by every waiter of a
    process: :meth:`watch` returns a queue that receives the events of one session until
    :meth:`unwatch`. The connection is taken from the pool at the first watch and held until
    :meth:`close`; a connection that drops is opened again at the next watch (a waiter reads the
    session's version after watching, so a commit in between is not missed)."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine
        self._conn: AsyncConnection | None = None
        self._raw: Any = None
        self._watchers: dict[str, set[asyncio.Queue[Event]]] = {}
        self._opening = asyncio.Lock()

    async def watch(self, session_id: str) -> asyncio.Queue[Event]:
        await self._open()
        queue: asyncio.Queue[Event] = asyncio.Queue()
        self._watchers.setdefault(session_id, set()).add(queue)
        return queue

    def unwatch(self, session_id: str, queue: asyncio.Queue[Event]) -> None:
        queues = self._watchers.get(session_id)
        if queues is not None:
            queues.discard(queue)
            if not queues:
                del self._watchers[session_id]

    async def wait(self, session_id: str, after_version: int, timeout_s: float,
                   read_version: Callable[[str], Awaitable[int]]) -> int | None:
        """A LISTEN: the commit's notification wakes it, with a read of the version when it
        starts and one when its time is up."""
        loop = asyncio.get_running_loop()
        until = loop.time() + timeout_s
        queue = await self.watch(session_id)
        try:
            # Read after watching: a commit between the caller's read and the LISTEN is seen.
            version = await read_version(session_id)
            while version <= after_version:
                left = until - loop.time()
                try:
                    if left <= 0:
                        raise TimeoutError
                    event = await asyncio.wait_for(queue.get(), left)
                except TimeoutError:
                    # One more read: a notification lost with a dropped connection is not a
                    # commit missed.
                    version = await read_version(session_id)
                    return version if version > after_version else None
                version = max(version, event.version)
            return version
        finally:
            self.unwatch(session_id, queue)

    async def _open(self) -> None:
        async with self._opening:
            if self._raw is not None and not self._raw.is_closed():
                return
            await self._drop()
            with translated():
                conn = await self._engine.connect()
                try:
                    raw: Any = (await conn.get_raw_connection()).driver_connection
                    await raw.add_listener(CHANNEL, self._notified)
                except BaseException:
                    with contextlib.suppress(Exception):
                        await conn.invalidate()
                    raise
            self._conn, self._raw = conn, raw

    def _notified(self, _conn: Any, _pid: int, _channel: str, payload: str) -> None:
        event = parse_event(payload)
        if event is None:
            return
        for queue in self._watchers.get(event.session, ()):
            queue.put_nowait(event)

    async def close(self) -> None:
        async with self._opening:
            await self._drop()

    async def _drop(self) -> None:
        conn, raw, self._conn, self._raw = self._conn, self._raw, None, None
        if conn is None:
            return
        with contextlib.suppress(Exception):
            if not raw.is_closed():
                await raw.remove_listener(CHANNEL, self._notified)
        with contextlib.suppress(Exception):
            # Never back to the pool: its next holder would go on listening.
            await conn.invalidate()
        with contextlib.suppress(Exception):
            await conn.close()
