"""Putting compaction runs on the queues.

Every enqueue goes through :class:`Enqueuer`, which sends ``compaction.run`` by name (the sender
never imports the tasks) on the queue its trigger belongs to. Sending is blocking kombu I/O, so
async callers hand it to a thread. Celery is never imported here: a runtime's process enqueues
through this module (``scheduler.client``) with an app it builds itself.

The enqueues that follow a signal mark (:func:`enqueue_marked`) and the one after an automatic run
(:func:`follow_up`) live here, below the scheduler, because the worker's tasks make them too.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import time
import uuid
from dataclasses import dataclass, replace
from typing import Any

from compactd.storage.kinds import RunCause
from compactd.storage.records import SessionInfo, utcnow
from compactd.storage.store import Store
from compactd.worker.keys import QUEUE_BULK, QUEUE_PRESSURE, QUEUE_URGENT, QUEUES, TASK_RUN
from compactd.worker.pressure import over_trigger
from compactd.worker.settings import Config

TRIGGER_QUEUES: dict[str, str] = {
    RunCause.OVERFLOW: QUEUE_URGENT, RunCause.MANUAL: QUEUE_URGENT,
    RunCause.WINDOW: QUEUE_URGENT,
    RunCause.PRESSURE: QUEUE_PRESSURE, RunCause.SWEEP: QUEUE_PRESSURE,
    RunCause.REAP: QUEUE_PRESSURE,
    RunCause.BULK: QUEUE_BULK,
}


@dataclass(frozen=True, slots=True)
class RunRequest:
    session_id: str
    trigger: str
    force: bool = False
    keep: str | None = None
    bulk_job_id: str | None = None
    rate_per_s: float | None = None
    task_id: str = ""
    # A manual run's focus (checked by the caller: storage.instructions).
    instructions: tuple[str, ...] = ()

    def kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "session_id": self.session_id, "trigger": self.trigger, "force": self.force,
            "keep": self.keep, "bulk_job_id": self.bulk_job_id, "rate_per_s": self.rate_per_s}
        if self.instructions:
            # Only when there are some: a worker of the release before takes no such argument.
            kwargs["instructions"] = list(self.instructions)
        return kwargs


def broker_errors() -> tuple[type[Exception], ...]:
    """What sending raises when the broker cannot be reached (kombu and redis are imported only
    when one is being handled)."""
    import kombu.exceptions
    import redis.exceptions

    return (kombu.exceptions.OperationalError, redis.exceptions.ConnectionError,
            redis.exceptions.TimeoutError, ConnectionError)


class Enqueuer:
    def __init__(self, app: Any) -> None:
        self.app = app

    def send(self, request: RunRequest) -> str:
        task_id = request.task_id or uuid.uuid4().hex
        self.app.send_task(TASK_RUN, kwargs=request.kwargs(),
                           queue=TRIGGER_QUEUES[request.trigger], task_id=task_id,
                           headers={"compactd_sent_at": time.time()})
        return task_id

    async def asend(self, request: RunRequest) -> str:
        return await asyncio.to_thread(self.send, request)

    def queue_depths(self) -> dict[str, int]:
        """Messages waiting in each of compactd's queues (unacked ones a worker holds are not
        waiting). Blocking broker I/O, like :meth:`send`."""
        from kombu.exceptions import ChannelError

        depths: dict[str, int] = {}
        with self.app.connection_for_read() as conn:
            channel = conn.default_channel
            for queue in QUEUES:
                try:
                    depths[queue] = channel.queue_declare(queue, passive=True).message_count
                except ChannelError:
                    # kombu's Redis transport knows a queue only while it holds a message.
                    depths[queue] = 0
        return depths


@dataclass(frozen=True, slots=True)
class Queued:
    task_id: str
    coalesced: bool  # True: an earlier request's task, queued and not started, stands for this


async def enqueue_manual(store: Store, enqueuer: Enqueuer, request: RunRequest, *,
                         ttl_s: float) -> Queued:
    """A manual run, coalesced as pressure signals are: while one for the session is queued and
    not started (its worker clears the mark when the run starts), a request gets that task's id
    instead of a second task on ``compaction.urgent``, the queue every tenant's overflow runs
    use. A mark older than ``ttl_s`` (a lost message) is taken over. The request's
    instructions are kept on the mark, beside those of the requests coalesced into it."""
    task_id = request.task_id or uuid.uuid4().hex
    held = await store.mark_manual(request.session_id, task_id, ttl_s=ttl_s,
                                   instructions=request.instructions)
    if held != task_id:
        return Queued(held, coalesced=True)
    try:
        await enqueuer.asend(replace(request, task_id=task_id))
    except BaseException:
        await store.clear_manual(request.session_id, task_id)
        raise
    return Queued(task_id, coalesced=False)



async def enqueue_marked(store: Store, enqueuer: Enqueuer, request: RunRequest) -> str:
    """Enqueue for a session whose signal mark we just set; if the broker refuses, clear the mark
    so the next signal tries again instead of waiting out the TTL."""
    try:
        return await enqueuer.asend(request)
    except Exception:
        await store.clear_signal(request.session_id)
        raise


async def follow_up(store: Store, config: Config, enqueuer: Enqueuer, info: SessionInfo, *,
                    run_started_at: dt.datetime) -> str | None:
    """Signal again for a session whose automatic run just ended, when appends made while it ran
    put the session over its trigger again.

    Those appends found the run's signal mark set and did not enqueue; without this the session
    would wait for the runtime's next append or the pressure sweep. Only appends newer than the
    run count, so a run that could not bring relief on its own does not re-enqueue itself (the
    loop guard deals with that).

    ``info`` is the session as read after the run's signal mark was cleared (an append after
    that enqueues on its own).
    """
    now = utcnow()
    if info.last_append_at is None or info.last_append_at <= run_started_at:
        return None
    if info.cooldown_until is not None and info.cooldown_until > now:
        return None
    if not over_trigger(info, config):
        return None
    if not await store.mark_signal(info.id, ttl_s=config.worker.signal_ttl_s, now=now):
        return None
    return await enqueue_marked(store, enqueuer, RunRequest(info.id, RunCause.PRESSURE))
