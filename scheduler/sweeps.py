"""Beat sweeps: Postgres is the truth, signals are hints.

* :func:`sweep_pressure` walks every session in bounded ``SKIP LOCKED`` batches and enqueues those
  over their trigger with no live lease, no cool-down and no fresh signal, so a lost signal or a
  flushed Redis costs at most two sweep intervals.
* :func:`reap_leases` closes expired leases (the run becomes ``abandoned`` and its orphan
  ``compaction/start`` is ended) and re-enqueues the sessions still over their trigger, unless
  the loop guard is cooling them down.
"""

from __future__ import annotations

import datetime as dt
import logging
from dataclasses import dataclass

from scheduler.enqueue import Enqueuer, RunRequest
from scheduler.intake import enqueue_marked
from storage.records import ReapedLease, utcnow
from storage.store import Store
from worker.pressure import over_trigger
from worker.settings import Config

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SweepResult:
    scanned_batches: int
    enqueued: tuple[str, ...]


async def sweep_pressure(store: Store, config: Config, enqueuer: Enqueuer, *,
                         now: dt.datetime | None = None) -> SweepResult:
    now = now or utcnow()
    w = config.worker
    after: str | None = None
    batches = 0
    enqueued: list[str] = []
    while True:
        chosen, after = await store.select_for_sweep(
            decide=lambda info: over_trigger(info, config), now=now, limit=w.sweep_batch,
            after_id=after, fresh_signal_s=w.sweep_interval_s)
        batches += 1
        for info in chosen:
            await enqueue_marked(store, enqueuer, RunRequest(info.id, "sweep"))
            enqueued.append(info.id)
        if after is None:
            break
    if enqueued:
        logger.info("sweep enqueued sessions over their trigger",
                    extra={"action": "sweep", "enqueued": len(enqueued), "batches": batches})
    return SweepResult(batches, tuple(enqueued))


async def reap_leases(store: Store, config: Config, enqueuer: Enqueuer, *,
                      now: dt.datetime | None = None) -> list[ReapedLease]:
    now = now or utcnow()
    reaped = await store.reap_expired(now=now)
    for lease in reaped:
        logger.warning("reaped an expired lease; its run is abandoned",
                       extra={"action": "reap", "session_id": lease.session_id,
                              "run_id": lease.run_id, "owner": lease.owner})
        info = await store.get_session(lease.session_id)
        cooling = info.cooldown_until is not None and info.cooldown_until > now
        if over_trigger(info, config) and not cooling:
            # The dead run's signal mark would block signals until its TTL: replace it.
            await store.clear_signal(info.id)
            if await store.mark_signal(info.id, ttl_s=config.worker.signal_ttl_s, now=now):
                await enqueue_marked(store, enqueuer, RunRequest(info.id, "reap"))
    return reaped
