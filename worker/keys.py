"""Every queue name, task name and Redis key prefix, in one place."""

from __future__ import annotations

QUEUE_URGENT = "compaction.urgent"  # overflow reported by a runtime, manual runs someone awaits
QUEUE_PRESSURE = "compaction.pressure"  # signals and sweeps
QUEUE_BULK = "compaction.bulk"  # recompaction jobs; never starves the other two
QUEUES = (QUEUE_URGENT, QUEUE_PRESSURE, QUEUE_BULK)  # the queues runs are sent to
# Beat's ticks (sweep, reap, retention): every worker consumes it whatever its -Q, ahead of the
# run queues, so a backlog of runs never holds up the reap that frees their sessions.
QUEUE_HOUSEKEEPING = "compaction.housekeeping"

TASK_RUN = "compaction.run"
TASK_SWEEP = "compaction.sweep"
TASK_REAP = "compaction.reap"
TASK_RETENTION = "retention.purge"
TASK_WEBHOOK = "events.deliver"

RATE_PREFIX = "compactd:rate:"
RATE_PROVIDER = "provider"  # the global model-call meter

BREAKER_PREFIX = "compactd:breaker:"  # one circuit per summary candidate's endpoint


def bulk_meter(job_id: str) -> str:
    return f"bulk:{job_id}"
