"""Retention: what ``retention:`` says to keep no longer, purged by the beat's
``retention.purge`` task in bounded batches.

* Recall originals (the text of what compaction replaced, kept searchable) of messages appended
  more than ``retention.originals_days`` ago, in short transactions of ``DELETE_BATCH_ROWS``.
* Append idempotency keys older than ``retention.append_keys_hours`` (always: an append no
  longer answers from them), in the same batches.
* Whole sessions with no append for ``retention.sessions_idle_days``, deleted as ``compactd
  delete`` deletes one (``storage.deletion``); a session that appended since it was picked, or
  holds a live lease, is left.

Each run records when it finished and what it removed (``beat_runs``), which ``compactd
status`` shows; a run stops at ``PURGE_BATCHES`` batches and ``PURGE_SESSIONS`` sessions, and the
next run goes on.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import asdict, dataclass

from compactd.storage.deletion import DELETE_BATCH_ROWS
from compactd.storage.errors import SessionNotFound
from compactd.storage.records import utcnow
from compactd.storage.store import Store
from compactd.worker.settings import RetentionConfig

# The name its runs are recorded under (beat_runs.name).
RETENTION_RUN = "retention"
# Transactions of originals one run deletes at most, and sessions: a backlog (retention turned
# on over a long history) is worked off over several runs.
PURGE_BATCHES = 100
PURGE_SESSIONS = 100


@dataclass(frozen=True, slots=True)
class PurgeResult:
    originals: int = 0
    sessions: int = 0
    session_rows: int = 0
    append_keys: int = 0

    def to_json(self) -> dict[str, int]:
        return asdict(self)


async def purge_expired(store: Store, retention: RetentionConfig, *,
                        now: dt.datetime | None = None) -> PurgeResult:
    """Purge what ``retention`` keeps no longer as of ``now``, and record the run."""
    now = now or utcnow()
    append_keys = 0
    keys_before = now - dt.timedelta(seconds=retention.append_key_window_s)
    for _ in range(PURGE_BATCHES):
        purged = await store.purge_append_keys(created_before=keys_before,
                                               limit=DELETE_BATCH_ROWS)
        append_keys += purged
        if purged < DELETE_BATCH_ROWS:
            break
    originals = 0
    if retention.originals_days is not None:
        before = now - dt.timedelta(days=retention.originals_days)
        for _ in range(PURGE_BATCHES):
            purged = await store.purge_originals(appended_before=before, limit=DELETE_BATCH_ROWS)
            originals += purged
            if purged < DELETE_BATCH_ROWS:
                break
    sessions = rows = 0
    if retention.sessions_idle_days is not None:
        idle_before = now - dt.timedelta(days=retention.sessions_idle_days)
        for session_id in await store.idle_sessions(idle_before=idle_before,
                                                    limit=PURGE_SESSIONS):
            try:
                deleted = await store.delete_session(session_id, idle_before=idle_before)
            except SessionNotFound:
                continue  # deleted meanwhile
            if deleted is not None:
                sessions += 1
                rows += sum(deleted.rows.values())
    result = PurgeResult(originals=originals, sessions=sessions, session_rows=rows,
                         append_keys=append_keys)
    await store.record_beat_run(RETENTION_RUN, result=result.to_json())
    return result
