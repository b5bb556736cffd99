"""Pressure-signal intake: validated payloads, de-duplicated per session.

A signal is a hint. It enqueues a run only when the session's trigger fires, the session is not
cooling down (loop guard), and no other signal's run is queued or running (the ``signal_at`` mark,
set in the same statement that checks it). A burst of signals therefore makes one task. Losing the
task (a Redis flush) loses nothing: the pressure sweep finds every session over its trigger.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from compactd.storage.errors import InvalidMessage
from compactd.storage.kinds import RunCause, SignalReason
from compactd.storage.records import utcnow
from compactd.storage.store import Store
from compactd.worker.enqueue import Enqueuer, RunRequest, enqueue_marked
from compactd.worker.pressure import explain
from compactd.worker.settings import Config, plain_problem

QUEUED = "a compaction is already queued or running"


class SignalPayload(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    session: str = Field(min_length=1, max_length=255)
    reason: SignalReason = SignalReason.PRESSURE


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
        raise InvalidMessage(plain_problem(first), field=field) from None


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
    if info.signal_live(now, ttl_s) or \
            not await store.mark_signal(info.id, ttl_s=ttl_s, now=now):
        return SignalResult(info.id, False, QUEUED)
    task_id = await enqueue_marked(store, enqueuer, RunRequest(info.id, RunCause.PRESSURE))
    return SignalResult(info.id, True, why, task_id)

