"""Pressure-signal intake: validated payloads, de-duplicated per session.

A signal is a hint. It enqueues a run only when the session's trigger fires, the session is not
cooling down (loop guard), and no other signal's run is queued or running (the ``signal_at`` mark,
set in the same statement that checks it). A burst of signals therefore makes one task. Losing the
task (a Redis flush) loses nothing: the pressure sweep finds every session over its trigger.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from scheduler.enqueue import Enqueuer, RunRequest
from storage.errors import InvalidMessage
from storage.records import SessionInfo, utcnow
from storage.store import Store
from worker.pressure import explain, over_trigger
from worker.settings import Config

QUEUED = "a compaction is already queued or running"


class SignalPayload(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    session: str = Field(min_length=1, max_length=255)
    reason: Literal["pressure", "step", "append"] = "pressure"


@dataclass(frozen=True, slots=True)
class SignalResult:
    session: str
    enqueued: bool
    reason: str
    task_id: str | None = None

    def to_json(self) -> dict[str, object]:
        return {"session": self.session, "enqueued": self.enqueued, "reason": self.reason,
                "task_id": self.task_id}


def parse_signal(raw: object) -> SignalPayload:
    try:
        return SignalPayload.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or None
        raise InvalidMessage(first["msg"], field=field) from None


async def accept_signal(store: Store, config: Config, enqueuer: Enqueuer,
                        payload: SignalPayload) -> SignalResult:
    info = await store.get_session(payload.session)
    fired, why, _ = explain(info, config)
    now = utcnow()
    if not fired:
        return SignalResult(info.id, False, f"not compacting: {why}")
    if info.cooldown_until is not None and info.cooldown_until > now:
        return SignalResult(info.id, False,
                            f"cooling down until {info.cooldown_until.isoformat()} (loop guard)")
    ttl_s = config.worker.signal_ttl_s
    # A live mark seen in the read answers a burst without a write per signal; a mark that looks
    # free is still taken by the atomic update, which is what decides between racing signals.
    if (info.signal_at is not None and info.signal_at > now - dt.timedelta(seconds=ttl_s)) or \
            not await store.mark_signal(info.id, ttl_s=ttl_s, now=now):
        return SignalResult(info.id, False, QUEUED)
    task_id = await enqueue_marked(store, enqueuer, RunRequest(info.id, "pressure"))
    return SignalResult(info.id, True, why, task_id)


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
    return await enqueue_marked(store, enqueuer, RunRequest(info.id, "pressure"))
