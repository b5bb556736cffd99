"""Celery tasks: thin, named with dots, given ids not rows, safe to run twice.

Each hands its coroutine to the process's event loop (``worker.runtime``) and waits. A failed
compaction raises :class:`CompactionFailed` so Flower shows the task as failed with its class;
``busy`` and ``changed`` are contention, not faults, a run whose lease an operator released
ended as asked, and a ``partial`` run committed some of its steps (the session shrank) before
it failed: they return normally with the class in the result. Either way the run row in
PostgreSQL is the record.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import random
import threading
import time
from typing import Any

from celery import Task, shared_task
from celery.signals import (
    task_postrun,
    task_prerun,
    worker_init,
    worker_process_init,
    worker_ready,
)

from compactd.storage.errors import (
    CompactdError,
    ConfigError,
    DatabaseUnavailable,
    SessionNotFound,
    StorageError,
)
from compactd.storage.instructions import first_instructions
from compactd.storage.kinds import FailureClass, ItemState, RunCause, RunStatus
from compactd.storage.records import utcnow
from compactd.storage.store import Store
from compactd.storage.tokens import load_counters
from compactd.worker import logs
from compactd.worker.enqueue import Enqueuer, broker_errors, follow_up
from compactd.worker.keys import TASK_REAP, TASK_RETENTION, TASK_RUN, TASK_SWEEP, TASK_WEBHOOK
from compactd.worker.llm.fallback import compute_backoff
from compactd.worker.llm.providers import import_sdks
from compactd.worker.metrics import FleetSnapshot, metrics, serve
from compactd.worker.orchestration import compact
from compactd.worker.pressure import Runway
from compactd.worker.retention import purge_expired
from compactd.worker.run import AUTOMATIC_TRIGGERS, Outcome
from compactd.worker.runtime import Deps, new_worker_loop, process_loop, reset_process_loop, tune_gc
from compactd.worker.settings import Config, load_config
from compactd.worker.sweeps import (
    index_recall,
    least_runways,
    reap_leases,
    release_dead_leases,
    sweep_pressure,
)
from compactd.worker.webhooks import backoff_s, post, send_run_event, webhook_for

logger = logging.getLogger(__name__)

# Failures an operator should see as failed tasks; the others are contention.
QUIET_FAILURES = (FailureClass.BUSY, FailureClass.CHANGED)
# A bulk item that finds its session leased is retried this many times, a third to two thirds
# of a lease apart (bulk_busy_countdown; an expired lease is closed by the next claim), before
# the item is marked failed.
BULK_BUSY_RETRIES = 12
# A run that could not reach a writable database (lost connections, a primary failing over) is
# sent again this many times, its waits doubling up to the cap: long enough for a standby's
# promotion, short of hiding a database that is gone (the pressure sweep finds the session).
DATABASE_RETRIES = 10
DATABASE_RETRY_FIRST_S = 0.5
DATABASE_RETRY_CAP_S = 8.0


def database_retry_countdown(retries_done: int, rng: random.Random | None = None) -> float:
    """The wait before a run's retry number ``retries_done + 1`` after the database was
    unavailable, jittered: after a failover every worker's runs fail at once, and retries in
    lockstep would meet the new primary together."""
    return compute_backoff(retries_done + 1, initial_s=DATABASE_RETRY_FIRST_S,
                           max_s=DATABASE_RETRY_CAP_S, rng=rng)


def bulk_busy_countdown(retries_done: int, lease_s: float,
                        rng: random.Random | None = None) -> float:
    """The wait before a bulk item's retry after its session was leased by another run: a
    third to two thirds of a lease, drawn afresh each time. Never sooner than a third (twelve
    retries outlast four leases), and jittered: a bulk job sends many items at once, and those
    that met busy sessions together would otherwise come back together, lease after lease. The
    wait does not double: the holder's lease ends within a lease whatever the retry's number."""
    return compute_backoff(retries_done + 1, initial_s=2 * lease_s / 3, max_s=2 * lease_s / 3,
                           rng=rng)


async def _keep_instructions(deps: Deps, session_id: str, task_id: str,
                             focus: tuple[str, ...], outcome: Outcome | None) -> None:
    """A manual task's run that ended without its run row taking its instructions (it found
    the session leased, or failed before): they go back on the session's manual mark for the
    next manual run (the outcome is the answer to this request, whatever becomes of them).
    Its own mark is handed back whatever the outcome, when the run did not take it."""
    if outcome is not None and outcome.failure_class == FailureClass.BUSY:
        # What an earlier delivery's run row holds is handed back too: that run may be the
        # one holding the session, its worker killed, and never commit.
        # Its deliveries' rows may hold more distinct texts between them than one run takes
        # (each took at most MAX_INSTRUCTIONS, not the same ones): the first are handed back,
        # the rest stay on those rows and are said to be dropped, not raised at the task.
        every = tuple(dict.fromkeys(
            (*focus, *await deps.store.task_instructions(task_id))))
        focus = first_instructions(every)
        if len(every) > len(focus):
            logger.warning("a busy manual run's deliveries held %d distinct instructions; the "
                           "first %d go back on the session's mark, the rest are dropped",
                           len(every), len(focus),
                           extra={"action": "compaction.instructions_dropped",
                                  "session_id": session_id})
    else:
        focus = ()
    try:
        kept = await deps.store.keep_manual(session_id, focus, task_id=task_id)
    except SessionNotFound:
        return  # deleted meanwhile: no run will want them
    if not kept:
        logger.warning("a busy manual run's instructions were not kept: the session's next "
                       "manual run would carry more than it may",
                       extra={"action": "compaction.instructions_dropped",
                              "session_id": session_id})


class CompactionFailed(Exception):
    """A compaction ended as failed; the message starts with its failure class."""


def _config(app: Any) -> Config:
    config = getattr(app.conf, "compactd_config", None)
    return config if isinstance(config, Config) else load_config()


@shared_task(name=TASK_RUN, bind=True, acks_late=True)
def run(self: Task, session_id: str, trigger: str = RunCause.PRESSURE, force: bool = False,
        keep: str | None = None, bulk_job_id: str | None = None,
        rate_per_s: float | None = None, instructions: list[str] | None = None
        ) -> dict[str, Any]:
    config = _config(self.app)
    # Read the request here: it is thread-local, and the coroutine runs on the loop's thread.
    task_id = self.request.id
    sent_at = getattr(self.request, "compactd_sent_at", None) or (
        self.request.headers or {}).get("compactd_sent_at")
    if isinstance(sent_at, int | float):
        queue = (self.request.delivery_info or {}).get("routing_key") or "unknown"
        metrics().queue_wait.labels(queue).observe(max(0.0, time.time() - sent_at))

    # A manual task's mark keeps the instructions of the requests it stands for until its run,
    # holding the lease, moves them onto its run row (orchestration: take_manual): a delivery
    # killed before that leaves them there for the next, one killed after on its run row.
    marked = trigger == RunCause.MANUAL and bool(task_id)

    async def go(deps: Deps) -> Outcome:
        started_at = utcnow()
        outcome: Outcome | None = None
        focus = tuple(instructions or ())
        try:
            # The loop thread has its own context: bind here too (compact adds the run id).
            with logs.bind(session_id=session_id, task_id=task_id):
                outcome = await compact(deps, session_id, trigger=trigger, force=force,
                                        keep=keep, task_id=task_id, bulk_job_id=bulk_job_id,
                                        rate_per_s=rate_per_s, index_in_background=True,
                                        instructions=focus)
            if marked:
                await _keep_instructions(deps, session_id, task_id, focus, outcome)
            await send_run_event(self.app, config, deps.store, session_id, outcome)
            return outcome
        except DatabaseUnavailable:
            raise  # retried: its next delivery takes the mark
        except Exception:
            if marked and outcome is None:
                # Ended before it held the lease: the mark goes to the next manual run.
                with contextlib.suppress(CompactdError):
                    await _keep_instructions(deps, session_id, task_id, focus, None)
            raise
        finally:
            if trigger in AUTOMATIC_TRIGGERS:
                # The signal's run is over: the next signal may enqueue again.
                after = await deps.store.clear_signal(session_id)
                # A partial run committed too: the appends its mark held back still count.
                committed = outcome is not None and outcome.outcome in (
                    RunStatus.COMMITTED, RunStatus.PARTIAL)
                if after is not None and committed:
                    try:
                        await follow_up(deps.store, config, Enqueuer(self.app), after,
                                        run_started_at=started_at)
                    except Exception as exc:
                        # The run itself succeeded; the pressure sweep finds the session.
                        logger.warning("follow-up signal failed: %s", exc,
                                       extra={"action": "follow_up_failed",
                                              "session_id": session_id})

    # The threads pool does not enforce task_time_limit: this wait does. Past it, the run is
    # cancelled on the loop (recorded as cancelled, its lease released) and the task fails.
    try:
        outcome = process_loop(config).run(go, timeout=config.worker.task_time_limit_s)
    except DatabaseUnavailable as exc:
        # Nothing of the run is committed that its next claim would not see: send it again.
        if self.request.retries >= DATABASE_RETRIES:
            raise
        countdown = database_retry_countdown(self.request.retries)
        logger.warning("the database is unavailable; the run is retried in %.1f s: %s",
                       countdown, exc, extra={"action": "compaction.retry_unavailable",
                                              "session_id": session_id})
        raise self.retry(countdown=countdown, max_retries=DATABASE_RETRIES) from exc
    if outcome.run_id and getattr(_task_logs, "token", None) is not None:
        # Celery's own "succeeded" / "raised" line for this task follows in this thread.
        logs.bind_more(run_id=outcome.run_id)
    if bulk_job_id is not None and outcome.failure_class == FailureClass.BUSY:
        # Another run holds the session (or this item is a duplicate delivery still running):
        # try again after the lease has had time to end, or the bulk job would wait forever.
        if self.request.retries < BULK_BUSY_RETRIES:
            raise self.retry(countdown=bulk_busy_countdown(self.request.retries,
                                                           config.worker.lease_s),
                             max_retries=BULK_BUSY_RETRIES)
        process_loop(config).run(lambda deps: deps.store.mark_bulk_items(
            bulk_job_id, [session_id], ItemState.FAILED,
            from_states=[ItemState.PENDING, ItemState.ENQUEUED]))
    # A run whose lease an operator released ended as asked: the task succeeds, its result
    # saying so (released_by), and only runs that broke show as failed in Flower.
    if (outcome.failed and outcome.failure_class not in QUIET_FAILURES
            and outcome.released_by is None):
        raise CompactionFailed(f"{outcome.failure_class}: {outcome.error}")
    return outcome.brief()


@shared_task(name=TASK_SWEEP, bind=True, ignore_result=True)
def sweep(self: Task) -> int:
    config = _config(self.app)
    enqueuer = Enqueuer(self.app)

    async def go(deps: Deps) -> tuple[int, list[Runway], dt.datetime | None]:
        result = await sweep_pressure(deps.store, config, enqueuer)
        try:
            await index_recall(deps.store, config)
        except StorageError as exc:
            # The pressure sweep's work is done; the next sweep indexes what this one did not.
            logger.warning("recall indexing in the sweep failed: %s", exc,
                           extra={"action": "sweep.recall_index_failed"})
        flagged = await deps.store.flagged_sessions()
        metrics().flagged_sessions.set(len(flagged))
        runways = await least_runways(deps.store, config)
        return len(result.enqueued), runways, await deps.store.oldest_signal()

    enqueued, runways, oldest = process_loop(config).run(go)
    try:
        depths = enqueuer.queue_depths()
    except broker_errors() as exc:
        # The sweep's work is done; the fleet's numbers go without the queues this time.
        logger.warning("queue depths not read: %s", type(exc).__name__,
                       extra={"action": "metrics.queue_depths_failed"})
        depths = {}
    metrics().fleet.update(FleetSnapshot(
        taken_at=time.monotonic(), interval_s=config.worker.sweep_interval_s,
        runways=tuple(r.seconds for r in runways), queue_depths=depths,
        oldest_signal_age_s=(utcnow() - oldest).total_seconds() if oldest else None))
    return enqueued


@shared_task(name=TASK_REAP, bind=True, ignore_result=True)
def reap(self: Task) -> int:
    config = _config(self.app)
    enqueuer = Enqueuer(self.app)

    async def go(deps: Deps) -> int:
        reaped = await reap_leases(deps.store, config, enqueuer)
        metrics().lease_reaps.inc(len(reaped))
        return len(reaped)

    return process_loop(config).run(go)


@shared_task(name=TASK_RETENTION, bind=True, ignore_result=True)
def retention(self: Task) -> dict[str, int]:
    config = _config(self.app)

    async def go(deps: Deps) -> dict[str, int]:
        return (await purge_expired(deps.store, config.retention)).to_json()

    purged = process_loop(config).run(go)
    m = metrics()
    for what in ("originals", "sessions", "session_rows", "append_keys"):
        m.retention_purged.labels(what).inc(purged[what])
    m.retention_last_run.set(time.time())
    return purged


@shared_task(name=TASK_WEBHOOK, bind=True, ignore_result=True, acks_late=True)
def deliver(self: Task, url: str, event: dict[str, Any], delivery_id: str) -> int | None:
    """POST one event to one webhook (:mod:`worker.webhooks`); tried again with backoff until
    ``events.retries`` retries failed, then dead-lettered. A webhook no longer configured
    (the configuration changed since) is dropped."""
    config = _config(self.app)
    kind = str(event.get("event"))
    hook = webhook_for(config, url)
    if hook is None:
        logger.warning("a delivery for a webhook no longer configured was dropped",
                       extra={"action": "events.webhook_dropped", "event": kind})
        return None
    try:
        status = post(hook, event, delivery_id)
        failure = None if 200 <= status < 300 else f"answered {status}"
    except Exception as exc:  # no answer: refused, reset, timed out, a bad address
        status, failure = None, f"{type(exc).__name__}: {exc}"
    if failure is None:
        metrics().webhook_deliveries.labels(kind, "delivered").inc()
        return status
    if self.request.retries >= config.events.retries:
        metrics().webhook_dead_letters.labels(kind).inc()
        logger.error("webhook delivery given up after %d retries: %s", self.request.retries,
                     failure, extra={"action": "events.webhook_dead_letter", "event": kind,
                                     "delivery_id": delivery_id})
        return status
    metrics().webhook_deliveries.labels(kind, "retried").inc()
    countdown = backoff_s(config, self.request.retries)
    logger.warning("webhook delivery failed (%s); tried again in %.1f s", failure, countdown,
                   extra={"action": "events.webhook_retry", "event": kind,
                          "delivery_id": delivery_id})
    raise self.retry(countdown=countdown, max_retries=config.events.retries)


# The log context of the compaction.run a task thread is running, from task_prerun to
# task_postrun (both in that thread), so Celery's own lines about the task, logged in between,
# carry the session and run ids too.
_task_logs = threading.local()


@task_prerun.connect
def _bind_task_logs(task_id: str | None = None, task: Any = None,
                    kwargs: dict[str, Any] | None = None, **_: Any) -> None:
    if getattr(task, "name", None) != TASK_RUN:
        return
    _task_logs.token = logs.push(session_id=(kwargs or {}).get("session_id"), task_id=task_id)


@task_postrun.connect
def _unbind_task_logs(**_: Any) -> None:
    token, _task_logs.token = getattr(_task_logs, "token", None), None
    if token is not None:
        logs.pop(token)


@worker_init.connect
def _prepare_process(sender: Any = None, **_: Any) -> None:
    config = _config(sender.app)
    # Before the worker consumes anything: the first compaction must not wait for them, and no
    # import may ever run on the event loop (see worker.llm.providers).
    import_sdks(config.models)
    # Parsing an encoding's BPE file is slow (docs/benchmarks.md): paid here, not by the first
    # run.
    load_counters([None, *(m.name for m in config.models), *(m.model_id for m in config.models)])
    # Now, so a worker configured for a loop it cannot have does not start. Celery logs a
    # handler's exception and goes on (every task would then fail); SystemExit it lets through.
    try:
        new_worker_loop(config.worker.event_loop)
    except ConfigError as exc:
        raise SystemExit(f"compactd worker: {exc}") from None
    # After the imports, so they are among what the collector never rescans.
    tune_gc(config.worker.gc_threshold)


@worker_process_init.connect
def _after_fork(**_: Any) -> None:
    # A prefork child must not use the parent's loop, engine or sockets.
    reset_process_loop()


async def _release_dead_leases(config: Config, app: Any) -> None:
    store = Store.from_url(config.database_url, pool_size=1,
                           statement_cache=config.database.statement_cache)
    try:
        await release_dead_leases(store, config, Enqueuer(app))
    finally:
        await store.close()


@worker_ready.connect
def _on_ready(sender: Any = None, **_: Any) -> None:
    config = _config(sender.app)
    try:
        # On a loop and a store of its own, closed after: a prefork pool's parent forks its
        # children after this, and must hold no loop thread and no database connection then.
        asyncio.run(_release_dead_leases(config, sender.app))
    except StorageError as exc:
        # The reaper ends them when they expire.
        logger.warning("the leases of this host's dead workers were not released: %s", exc,
                       extra={"action": "lease.release_dead_failed"})
    port = config.worker.metrics_port
    pool = type(getattr(sender, "pool", None)).__module__
    if port and pool.endswith(".prefork"):
        # Each child would count into its own registry; this endpoint would serve zeros.
        logger.error("metrics endpoint not started: the prefork pool is not supported, run the "
                     "worker with the threads pool (the default)",
                     extra={"action": "metrics.prefork", "port": port})
        return
    serve(port)
