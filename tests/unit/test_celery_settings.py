"""The Celery reliability settings the worker depends on (issue 5), checked where they are built.

The behaviour behind them is proven with real processes in tests/acceptance/test_worker.py; this
catches a setting dropped or changed by accident.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from compactd.worker import keys
from compactd.worker.app import VISIBILITY_MARGIN_S, celery_settings
from compactd.worker.keys import QUEUE_BULK, QUEUE_PRESSURE, QUEUE_URGENT, TASK_RUN
from compactd.worker.settings import Settings, build_config


def redis_settings(worker: dict[str, Any] | None = None) -> dict[str, Any]:
    config = build_config({"worker": worker or {}},
                          settings=Settings(broker_url="redis://127.0.0.1:6379/0",
                                            database_url="postgresql://x@127.0.0.1/x"),
                          home=Path("/nonexistent"))
    return celery_settings(config)


def test_late_acks_prefetch_one_and_json_only() -> None:
    s = redis_settings()
    assert s["task_acks_late"] is True
    assert s["task_reject_on_worker_lost"] is True
    assert s["worker_prefetch_multiplier"] == 1
    assert s["task_serializer"] == s["result_serializer"] == s["event_serializer"] == "json"
    assert s["accept_content"] == ["json"]


def test_visibility_timeout_outlives_the_longest_task() -> None:
    s = redis_settings({"task_time_limit_s": 120, "deadline_s": 100})
    transport = s["broker_transport_options"]
    assert transport["visibility_timeout"] == 120 + VISIBILITY_MARGIN_S
    assert transport["visibility_timeout"] > s["task_time_limit"]


def test_connection_loss_shutdown_and_events() -> None:
    s = redis_settings()
    assert s["worker_cancel_long_running_tasks_on_connection_loss"] is True
    assert s["broker_connection_max_retries"] is None
    assert s["worker_soft_shutdown_timeout"] > 0
    assert s["worker_enable_soft_shutdown_on_idle"] is False
    assert s["worker_send_task_events"] is True and s["task_send_sent_event"] is True


def test_threads_pool_and_queues() -> None:
    s = redis_settings({"concurrency": 48})
    assert s["worker_pool"] == "threads" and s["worker_concurrency"] == 48
    assert [q.name for q in s["task_queues"]] == [keys.QUEUE_HOUSEKEEPING, QUEUE_URGENT,
                                                  QUEUE_PRESSURE, QUEUE_BULK]
    assert s["task_routes"][TASK_RUN] == {"queue": QUEUE_PRESSURE}
    # Beat's ticks are not held up by a backlog of runs (acceptance/test_housekeeping_queue.py).
    for tick in (keys.TASK_SWEEP, keys.TASK_REAP, keys.TASK_RETENTION):
        assert s["task_routes"][tick] == {"queue": keys.QUEUE_HOUSEKEEPING}
    assert s["task_create_missing_queues"] is False
