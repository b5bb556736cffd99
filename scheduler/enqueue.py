"""Putting compaction runs on the queues.

Every enqueue goes through :class:`Enqueuer`, which sends ``compaction.run`` by name (the sender
never imports the tasks) on the queue its trigger belongs to. Sending is blocking kombu I/O, so
async callers hand it to a thread.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from worker.keys import QUEUE_BULK, QUEUE_PRESSURE, QUEUE_URGENT, QUEUES, TASK_RUN

if TYPE_CHECKING:
    from storage.store import Store

TRIGGER_QUEUES = {
    "overflow": QUEUE_URGENT, "manual": QUEUE_URGENT,
    "pressure": QUEUE_PRESSURE, "sweep": QUEUE_PRESSURE, "reap": QUEUE_PRESSURE,
    "bulk": QUEUE_BULK,
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

    def kwargs(self) -> dict[str, Any]:
        return {"session_id": self.session_id, "trigger": self.trigger, "force": self.force,
                "keep": self.keep, "bulk_job_id": self.bulk_job_id,
                "rate_per_s": self.rate_per_s}


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
    use. A mark older than ``ttl_s`` (a lost message) is taken over."""
    task_id = request.task_id or uuid.uuid4().hex
    held = await store.mark_manual(request.session_id, task_id, ttl_s=ttl_s)
    if held != task_id:
        return Queued(held, coalesced=True)
    try:
        await enqueuer.asend(replace(request, task_id=task_id))
    except BaseException:
        await store.clear_manual(request.session_id, task_id)
        raise
    return Queued(task_id, coalesced=False)


class RecordingEnqueuer(Enqueuer):
    """An enqueuer that only records (dry runs, and unit tests of the scheduler's decisions)."""

    def __init__(self) -> None:
        super().__init__(app=None)
        self.sent: list[RunRequest] = []

    def send(self, request: RunRequest) -> str:
        task_id = request.task_id or uuid.uuid4().hex
        self.sent.append(request)
        return task_id
