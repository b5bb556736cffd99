"""What a run expects the agent to append before it picks the checkpoint up (``keep_at:
pickup``): the session's appends at the cadence of its newest ones (their times as appended,
read once per run), or its growth rate when they are too few or the session has paused, over
the claim-to-commit time of recent runs of the same summary model, and the step the agent
appends before the read that picks the checkpoint up (``worker.compaction.arrivals``).

The claim-to-commit time is this module's own statistic: the lead time of a pressure signal
(signal to checkpoint) is measured elsewhere and includes the wait in the queue, which comes
before the claim and so before the read the kept tail is cut from.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Sequence

from compactd.storage.errors import StorageError
from compactd.storage.records import SessionInfo
from compactd.storage.store import Store
from compactd.storage.surface import SurfaceNode
from compactd.worker.compaction.arrivals import (
    RECENT_MESSAGES,
    Arrivals,
    Cadence,
    append_cadence,
    arrivals_at_cadence,
    claim_to_commit_s,
    expected_arrivals,
)
from compactd.worker.compaction.policy import Policy
from compactd.worker.llm.candidates import candidate_order
from compactd.worker.settings import Config

logger = logging.getLogger(__name__)

# How far back the claim-to-commit durations are read: recent enough to follow a model whose
# latency changed, long enough that a quiet fleet still has some.
RECENT_RUNS_S = 3600.0
RECENT_RUNS = 64


async def claim_to_commit_seconds(store: Store, config: Config, info: SessionInfo,
                                  policy: Policy, now: dt.datetime) -> float | None:
    """The expected claim-to-commit seconds of a run of ``info`` (None: no recent run, or
    the read failed; the run then keeps at the claim)."""
    first = candidate_order(run_model=info.run_model, summary_model=policy.model_name,
                            models=config.models, default_model=config.default_model,
                            local_fallback=config.worker.local_fallback)
    model = first[0].model_id if first else None
    since = now - dt.timedelta(seconds=RECENT_RUNS_S)
    try:
        durations = await store.claim_to_commit_durations(model, since=since,
                                                               limit=RECENT_RUNS)
    except StorageError as exc:
        logger.warning("keep_at: recent runs unreadable; keeping at the claim",
                       extra={"action": "keep_at.unread", "error": str(exc)})
        return None
    return claim_to_commit_s(durations)


async def session_cadence(store: Store, info: SessionInfo) -> Cadence | None:
    """How ``info`` has been appending, from its newest messages' append times (None: too few
    appends, or the read failed; the run then counts the growth rate)."""
    try:
        appended = await store.recent_messages(info.id, limit=RECENT_MESSAGES)
    except StorageError as exc:
        logger.warning("keep_at: recent appends unreadable; counting the growth rate",
                       extra={"action": "keep_at.appends_unread", "session_id": info.id,
                              "error": str(exc)})
        return None
    return append_cadence(appended)


async def predict_arrivals(store: Store, config: Config, info: SessionInfo, policy: Policy,
                           nodes: Sequence[SurfaceNode], now: dt.datetime) -> Arrivals | None:
    """What the agent is expected to append before the pickup, or None when the run keeps at
    the claim: ``keep_at: claim``, a session not growing (no agent stepping: an idle chat's
    next message may be hours away), or no run to learn the claim-to-commit time from (a
    fresh worker's first runs, an ingested history's). Counted at the session's append cadence
    while it steps at it, else at its growth rate."""
    if policy.keep_at != "pickup":
        return None
    # The rate the lead counts: a young session's stored rate is still climbing from 0 (a
    # fifth of its true rate ten seconds in), and the arrivals it would give fall short.
    rate = info.growth_at(now)
    if rate <= 0:
        return None
    seconds = await claim_to_commit_seconds(store, config, info, policy, now)
    if seconds is None:
        return None
    cadence = await session_cadence(store, info)
    if cadence is not None and cadence.stepping_at(now):
        return arrivals_at_cadence(cadence, seconds)
    return expected_arrivals(rate, seconds, nodes)
