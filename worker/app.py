"""The Celery app: ``celery -A compactd.worker.app worker | beat | flower``.

Built from the process's configuration (``COMPACTD_*`` environment and the YAML file) when Celery
asks for ``worker.app.app``, not when this module is imported. Clients that only enqueue (the CLI,
``scheduler.client`` in a runtime's process) build their own with :func:`client_app`, which
changes nothing global: no tasks, no logging or Flower hooks.
"""

from __future__ import annotations

import logging
from functools import cache
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import click
from celery import Celery
from celery.signals import celeryd_after_setup, setup_logging
from click.core import ParameterSource
from kombu import Exchange, Queue

from compactd.worker import broker, logs
from compactd.worker.keys import (
    QUEUE_BULK,
    QUEUE_HOUSEKEEPING,
    QUEUE_PRESSURE,
    QUEUE_URGENT,
    TASK_REAP,
    TASK_RETENTION,
    TASK_RUN,
    TASK_SWEEP,
    TASK_WEBHOOK,
)
from compactd.worker.settings import Config, broker_dirs, load_config

# How much longer than the longest task a Redis message stays invisible before redelivery.
VISIBILITY_MARGIN_S = 300


def _kombu_broker_url(config: Config) -> str:
    """The broker URL as kombu reads it. The filesystem transport never uses a host, but kombu
    falls back to ``localhost`` for a URL without one and warns about it on every connection
    (each ``compactd compact`` without a server): the embedded URL names that host itself."""
    url = urlsplit(config.broker_url)
    if not config.embedded_broker or url.hostname:
        return config.broker_url
    return urlunsplit(url._replace(netloc="localhost", path=url.path or "/"))


def celery_settings(config: Config) -> dict[str, Any]:
    w = config.worker
    transport: dict[str, Any] = {}
    if config.embedded_broker:
        transport.update(broker_dirs(config.home))
    else:
        # Redis re-delivers an unacked message after the visibility timeout. It must exceed the
        # longest a task can run, or a slow compaction is handed to a second worker mid-run
        # (harmless thanks to the lease, but wasted model calls).
        transport["visibility_timeout"] = int(w.task_time_limit_s + VISIBILITY_MARGIN_S)
        # Beat's ticks, then urgent, pressure, bulk, at every free slot (see worker.broker).
        transport["queue_order_strategy"] = broker.QUEUE_ORDER
    exchange = Exchange("compactd", type="direct")
    return {
        "broker_url": _kombu_broker_url(config),
        "broker_transport_options": transport,
        "broker_connection_retry_on_startup": True,
        # Keep retrying a lost broker forever: a Redis restart must not kill the worker.
        "broker_connection_max_retries": None,
        # JSON only: no pickle ever crosses the broker.
        "task_serializer": "json",
        "result_serializer": "json",
        "accept_content": ["json"],
        "event_serializer": "json",
        # Results live in PostgreSQL (compaction_runs), which is where --wait and status read
        # them; a result backend would be a second, weaker copy.
        "task_ignore_result": True,
        "result_backend": None,
        # Late acks: a task is acked only when it ends, so a worker killed mid-run leaves its
        # message to be redelivered. Safe because tasks are idempotent: a rerun finds the lease
        # (busy), the work done (nothing_to_do), or the reaped run and starts again cleanly.
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        # One message per free slot: a worker never hoards messages another worker could run.
        "worker_prefetch_multiplier": 1,
        # With late acks, a task still running when the broker connection drops can no longer
        # be acked and will be redelivered; cancel it rather than let two copies run. Celery
        # cannot stop a thread, so on the threads pool the cancel is refused ("Failed to
        # cancel active request" in the log) and the run carries on under its lease: it
        # commits or fails cleanly in PostgreSQL, and a redelivered copy finds the lease
        # (busy) or the work done (nothing_to_do). On a prefork pool the cancel takes effect.
        "worker_cancel_long_running_tasks_on_connection_loss": True,
        # Warm shutdown (SIGTERM) stops consuming and waits for the running compactions, each
        # bounded by worker.deadline_s, so they commit or fail and release their leases. A cold
        # shutdown (SIGQUIT, or SIGTERM with CELERY_REMAP_SIGTERM=SIGQUIT) is softened: runs
        # get this long before they are cancelled and their messages go back to the queue.
        "worker_soft_shutdown_timeout": 30.0,
        # Soft shutdown on idle exists to requeue ETA tasks. The only ones here are webhook
        # deliveries waiting to be tried again (worker.webhooks): unacknowledged, they go back
        # to the queue when the broker channel closes, so an idle worker still stops at once.
        "worker_enable_soft_shutdown_on_idle": False,
        # Most of a compaction is waiting on a model: one process runs many on a threads pool,
        # each thread handing its coroutine to the process's single event loop. Celery uses
        # worker_pool when the command line gives no -P, so `celery -A compactd.worker.app worker`
        # runs threads ("concurrency: 64 (thread)" in its banner); an explicit -P overrides it.
        "worker_pool": "threads",
        "worker_concurrency": w.concurrency,
        # Time limits (enforced by the prefork pool; on the threads pool the orchestration's own
        # deadline, below these, is what bounds a run).
        "task_time_limit": w.task_time_limit_s,
        "task_soft_time_limit": max(1.0, w.task_time_limit_s - 10),
        # Task events for Flower.
        "worker_send_task_events": True,
        "task_send_sent_event": True,
        "task_track_started": True,
        "task_default_queue": QUEUE_PRESSURE,
        "task_default_exchange": "compactd",
        "task_default_routing_key": QUEUE_PRESSURE,
        "task_create_missing_queues": False,
        "task_queues": [Queue(q, exchange, routing_key=q) for q in
                        (QUEUE_HOUSEKEEPING, QUEUE_URGENT, QUEUE_PRESSURE, QUEUE_BULK)],
        # Beat's ticks have a queue of their own: on compaction.pressure a backlog of runs held
        # a reap until it expired, and the sessions of dead workers waited with it.
        "task_routes": {TASK_RUN: {"queue": QUEUE_PRESSURE},
                        TASK_SWEEP: {"queue": QUEUE_HOUSEKEEPING},
                        TASK_REAP: {"queue": QUEUE_HOUSEKEEPING},
                        TASK_RETENTION: {"queue": QUEUE_HOUSEKEEPING},
                        TASK_WEBHOOK: {"queue": QUEUE_PRESSURE}},
        "beat_schedule": {
            "sweep": {"task": TASK_SWEEP, "schedule": w.sweep_interval_s,
                      "options": {"expires": w.sweep_interval_s}},
            "reap": {"task": TASK_REAP, "schedule": w.reap_interval_s,
                     "options": {"expires": w.reap_interval_s}},
            # Always: expired append idempotency keys are purged whatever else is kept.
            "retention": {"task": TASK_RETENTION, "schedule": config.retention.interval_s,
                          "options": {"expires": config.retention.interval_s}},
        },
        "beat_schedule_filename": str(config.home / "celerybeat-schedule"),
        # compactd's own structured logging (worker.logs) is installed by the setup_logging
        # handler below; Celery must not re-route print()/stderr into its logger as WARNING.
        "worker_hijack_root_logger": False,
        "worker_redirect_stdouts": False,
        "timezone": "UTC",
    }


def make_app(config: Config, *, with_tasks: bool = False) -> Celery:
    """A Celery app for ``config``. It changes nothing process-wide: its connections resolve
    the Redis transport themselves (``worker.broker.AMQP``), so it can live in a runtime's
    process beside the runtime's own kombu or Celery."""
    app = Celery("compactd", set_as_current=with_tasks, amqp=broker.AMQP)
    app.conf.update(celery_settings(config))
    app.conf.compactd_config = config
    if with_tasks:
        app.conf.imports = ("compactd.worker.tasks",)
    return app


@cache
def client_app(config: Config) -> Celery:
    """An app for enqueueing only (one per configuration, shared by the process)."""
    return make_app(config)


def _logging(loglevel: int | str | None = None, **_: Any) -> None:
    # Connected: Celery leaves logging to us instead of installing its own handlers. Its
    # --loglevel, when the command line gives one, wins over COMPACTD_LOG_LEVEL; Celery passes
    # its own default (WARNING) when it does not, which must not silence the INFO default.
    config = load_config()
    level = config.log_level
    if loglevel is not None and _given_on_command_line("loglevel"):
        level = logging.getLevelName(loglevel) if isinstance(loglevel, int) else loglevel
    logs.configure(config.log_format, level)


def _given_on_command_line(option: str) -> bool:
    """Whether the Celery command running now (worker, beat, flower) got ``option`` from its
    command line or its environment, not from its default."""
    context = click.get_current_context(silent=True)
    while context is not None:
        if option in context.params:
            source = context.get_parameter_source(option)
            return source not in (None, ParameterSource.DEFAULT,
                                  ParameterSource.DEFAULT_MAP)
        context = context.parent
    return False


def _consume_housekeeping(instance: Any = None, **_: Any) -> None:
    # After -Q is applied: a worker started for some queues only (-Q compaction.urgent) takes
    # beat's ticks too, so no deployment is left without a reaper.
    queues = instance.app.amqp.queues
    queues.select_add(queues[QUEUE_HOUSEKEEPING])


@cache
def _worker_app() -> Celery:
    from compactd.worker import flower  # noqa: F401  (connects Flower's defaults)

    setup_logging.connect(_logging)
    celeryd_after_setup.connect(_consume_housekeeping)
    return make_app(load_config(), with_tasks=True)


def __getattr__(name: str) -> Any:
    # ``celery -A compactd.worker.app`` reads ``worker.app.app``: the worker's app, with its hooks,
    # is built then, and never in a process that imports this module for the functions above.
    if name == "app":
        return _worker_app()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
