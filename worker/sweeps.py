"""Beat sweeps: Postgres is the truth, signals are hints. The worker's beat tasks run them.

* :func:`sweep_pressure` refreshes the lead each pool fires by (``worker.lead``), then enqueues
  the sessions over their trigger (counting their growth over that lead) with no live lease, no
  cool-down and no fresh signal, so a lost signal or a flushed Redis costs at most two sweep
  intervals. It
  reads only the sessions an index holds as over their stored thresholds (``SKIP LOCKED``, in
  bounded batches), after storing the thresholds of sessions new or changed since the last sweep.
* :func:`least_runways` lists every growing session's runway, which the sweep task exports as
  metrics and ``compactd status`` shows.
* :func:`index_recall` indexes the text of replaced originals no worker indexed after its
  commit (``storage.recall_index``).
* :func:`reap_leases` closes expired leases (the run becomes ``abandoned`` and its orphan
  ``compaction/start`` is ended) and re-enqueues the sessions still over their trigger, unless
  the loop guard is cooling them down.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
from dataclasses import dataclass

from compactd.storage.errors import StorageError
from compactd.storage.kinds import RunCause
from compactd.storage.records import ReapedLease, SessionInfo, utcnow
from compactd.storage.store import Store
from compactd.worker.enqueue import Enqueuer, RunRequest, enqueue_marked
from compactd.worker.lead import refresh_leads
from compactd.worker.owners import Owner, format_owner, parse_owner, this_process
from compactd.worker.pressure import (
    Runway,
    over_trigger,
    sorted_runways,
    sweep_key,
    sweep_thresholds,
)
from compactd.worker.settings import Config

logger = logging.getLogger(__name__)

# Sessions whose thresholds one transaction stores: after a configuration change every session
# is resolved once, and a larger batch spends fewer round trips on it.
RESOLVE_BATCH = 1000
# Replaced originals one sweep indexes at most: a sweep that finds a backlog (a database
# migrated with a long history) works it off over several sweeps.
RECALL_SWEEP_ORIGINALS = 2000


@dataclass(frozen=True, slots=True)
class SweepResult:
    scanned_batches: int
    enqueued: tuple[str, ...]
    resolved: int = 0


async def sweep_pressure(store: Store, config: Config, enqueuer: Enqueuer, *,
                         now: dt.datetime | None = None) -> SweepResult:
    now = now or utcnow()
    w = config.worker
    key = sweep_key(config)
    resolved = 0
    batch = max(w.sweep_batch, RESOLVE_BATCH)
    # Most sessions share a few policies: resolve each (policy, model, window) once per sweep.
    seen: dict[tuple[str, str | None, int | None], dict[str, int | None]] = {}

    def resolve(info: SessionInfo) -> dict[str, int | None]:
        basis = (json.dumps(info.policy, sort_keys=True), info.run_model, info.context_window)
        if basis not in seen:
            seen[basis] = sweep_thresholds(info, config)
        return seen[basis]

    try:
        await refresh_leads(store, config, now=now)
    except StorageError as exc:
        # The sessions over their trigger come first; the leads stay as a worker last stored.
        logger.warning("the sweep did not refresh the checkpoint leads: %s", exc,
                       extra={"action": "sweep.lead_refresh_failed"})
    while True:
        n = await store.resolve_sweep_thresholds(key=key, resolve=resolve, limit=batch)
        resolved += n
        if n < batch:
            break
    after: str | None = None
    batches = 0
    enqueued: list[str] = []
    while True:
        chosen, after = await store.select_for_sweep(
            decide=lambda info: over_trigger(info, config, now), now=now, limit=w.sweep_batch,
            after_id=after, fresh_signal_s=w.sweep_interval_s)
        batches += 1
        for info in chosen:
            await enqueue_marked(store, enqueuer, RunRequest(info.id, RunCause.SWEEP))
            enqueued.append(info.id)
        if after is None:
            break
    if enqueued:
        logger.info("sweep enqueued sessions over their trigger",
                    extra={"action": "sweep", "enqueued": len(enqueued), "batches": batches})
    return SweepResult(batches, tuple(enqueued), resolved)


async def reap_leases(store: Store, config: Config, enqueuer: Enqueuer, *,
                      now: dt.datetime | None = None) -> list[ReapedLease]:
    now = now or utcnow()
    reaped = await store.reap_expired(now=now)
    for lease in reaped:
        logger.warning("reaped an expired lease; its run is abandoned",
                       extra={"action": "reap", "session_id": lease.session_id,
                              "run_id": lease.run_id, "owner": lease.owner})
        await _enqueue_if_pressed(store, config, enqueuer, lease.session_id, now)
    return reaped


async def _enqueue_if_pressed(store: Store, config: Config, enqueuer: Enqueuer, session_id: str,
                              now: dt.datetime) -> None:
    """Send a run for a session whose run was ended for it (its lease reaped or released),
    when it is still over its trigger and not cooling down."""
    info = await store.get_session(session_id)
    cooling = info.cooldown_until is not None and info.cooldown_until > now
    if over_trigger(info, config, now) and not cooling:
        # The dead run's signal mark would block signals until its TTL: replace it.
        await store.clear_signal(info.id)
        if await store.mark_signal(info.id, ttl_s=config.worker.signal_ttl_s, now=now):
            await enqueue_marked(store, enqueuer, RunRequest(info.id, RunCause.REAP))


async def release_dead_leases(store: Store, config: Config, enqueuer: Enqueuer, *,
                              me: Owner | None = None) -> list[ReapedLease]:
    """At a worker's start: release the leases of this host's worker processes that are gone
    (a crash, a kill), whose runs could not end, so their sessions do not wait for the leases
    to expire. Only leases whose owner (worker.owners) names this host AND this process's PID
    namespace: a pid means nothing in another one (a container sharing the host name), and an
    owner with no namespace (the old ``host:pid`` form) is left to expire. A pid that is still
    a process here (another worker, or one that took the number) is left to the reaper. The
    release is fenced to the run read, and its run ends abandoned, naming why; a session still
    under pressure is sent again, as the reaper does."""
    me = me or this_process()
    if me.namespace is None:
        return []  # no namespace to match: no pid of any lease can be checked from here
    released: list[ReapedLease] = []
    for info in await store.live_leases():
        owner = parse_owner(info.lease_owner)
        if (owner is None or owner.host != me.host or owner.namespace != me.namespace
                or not _gone(owner.pid, me.pid)):
            continue
        lease = await store.release_lease(info.id, run_id=info.lease_run_id,
                                          by=f"{format_owner(me)} at its start (process gone)")
        if lease is not None:
            logger.warning("released the lease of a worker process that is gone",
                           extra={"action": "lease.released_dead", "session_id": info.id,
                                  "run_id": lease.run_id, "owner": lease.owner})
            released.append(lease)
            await _enqueue_if_pressed(store, config, enqueuer, info.id, utcnow())
    return released


def _gone(pid: int, me: int) -> bool:
    if pid == me:
        return True  # this process is new: a lease in its name is a previous one's
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # a process of another user
    return False


async def index_recall(store: Store, config: Config) -> int:
    """Index what commits replaced and no worker indexed after them (a worker that died between
    its commit and the indexing, or a database migrated from before recall's indexing moved off
    the commit): at most ``RECALL_SWEEP_ORIGINALS`` a sweep."""
    if not config.worker.recall_index:
        return 0
    indexed = await store.index_recall(max_originals=RECALL_SWEEP_ORIGINALS)
    if indexed:
        logger.info("sweep indexed replaced originals for recall",
                    extra={"action": "sweep.recall_index", "indexed": indexed})
    return indexed


async def least_runways(store: Store, config: Config, *, now: dt.datetime | None = None,
                        idle_windows: float = 10.0) -> list[Runway]:
    """Every growing session's runway, least first (the sweep exports them as metrics): those
    that appended within ``idle_windows`` growth windows."""
    now = now or utcnow()
    return sorted_runways(await store.growing_sessions(now=now, idle_windows=idle_windows),
                          config, now)
