"""The lead each summary pool fires by (``worker.compaction.lead``), kept where the append reads
it: the ``checkpoint_leads`` table, one row per pool (``storage.leads``).

The beat sweep refreshes it, and so does a worker after a checkpoint (at most every
``LEAD_REFRESH_S``), since a deployment without beat must still learn its lead. ``auto``
measures it from the runs of the last ``LEAD_SAMPLE_S``; a configured lead is written as it is,
so the sweep's flag (``storage.schema.OVER_SWEEP_SQL``) counts the same lead as the append.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from compactd.storage.errors import StorageError
from compactd.storage.kinds import LeadBy
from compactd.storage.leads import ALL_POOLS, LeadRow, pool_of
from compactd.storage.records import SessionInfo, utcnow
from compactd.storage.store import Store
from compactd.worker.compaction.lead import (
    LEAD_MIN_RUNS,
    LEAD_PERCENTILE,
    LEAD_SAMPLE_RUNS,
    LEAD_SAMPLE_S,
    percentile,
)
from compactd.worker.pressure import FIRST, lead_parts, session_lead_s, session_policy
from compactd.worker.settings import Config

logger = logging.getLogger(__name__)

# How often a worker process refreshes the leads after its checkpoints: each refresh reads the
# newest runs, so a busy fleet must not do it per commit.
LEAD_REFRESH_S = 5.0
_refreshed_at = -LEAD_REFRESH_S


def measure_leads(config: Config, seconds_by_pool: dict[str, list[float]],
                  now: dt.datetime) -> list[LeadRow]:
    """The rows to store for the configuration and the measured signal-to-checkpoint seconds:
    with ``auto`` and no run measured, every pool's is the first lead."""
    if config.lead is not None:
        source = "off" if config.lead == 0 else "configured"
        return [LeadRow(ALL_POOLS, config.lead, source, 0, None, now)]
    every = [s for seconds in seconds_by_pool.values() for s in seconds]
    if not every:
        return [LeadRow(ALL_POOLS, config.first_lead_s, FIRST, 0, None, now)]
    rows = []
    for pool, seconds in sorted([(ALL_POOLS, every), *seconds_by_pool.items()]):
        if len(seconds) >= (1 if pool == ALL_POOLS else LEAD_MIN_RUNS):
            p = percentile(seconds, LEAD_PERCENTILE)
            rows.append(LeadRow(pool, p, "auto", len(seconds), p, now))
    return rows


async def refresh_leads(store: Store, config: Config, *, now: dt.datetime | None = None
                        ) -> list[LeadRow]:
    """Measure and store every pool's lead; the rows stored."""
    now = now or utcnow()
    by_pool: dict[str, list[float]] = defaultdict(list)
    if config.lead is None:
        for sample in await store.lead_samples(since=now - dt.timedelta(seconds=LEAD_SAMPLE_S),
                                               limit=LEAD_SAMPLE_RUNS):
            by_pool[sample.pool].append(sample.seconds)
    rows = measure_leads(config, by_pool, now)
    await store.store_leads(rows)
    return rows


async def refresh_after_checkpoint(store: Store, config: Config) -> None:
    """A worker's refresh after a committed checkpoint, at most every ``LEAD_REFRESH_S`` per
    process; a failure is logged (the sweep refreshes again)."""
    global _refreshed_at
    if time.monotonic() - _refreshed_at < LEAD_REFRESH_S:
        return
    _refreshed_at = time.monotonic()
    try:
        await refresh_leads(store, config)
    except StorageError as exc:
        logger.warning("the checkpoint lead was not refreshed: %s", exc,
                       extra={"action": "lead.refresh_failed"})


@dataclass(frozen=True, slots=True)
class LeadUsed:
    """The lead a session fires by, and why: what ``compactd status ID`` shows."""

    seconds: float
    source: str  # auto, first, configured, off, no_growth
    why: str
    runs: int | None = None
    p90_s: float | None = None
    # The tokens counted ahead (``worker.pressure.lead_parts``): its growth over the lead and
    # its next step; ``by`` names the larger ("growth" or "step"; None: neither counts).
    growth_tokens: int = 0
    step_tokens: int = 0

    @property
    def by(self) -> LeadBy | None:
        if not self.growth_tokens and not self.step_tokens:
            return None
        return LeadBy.STEP if self.step_tokens > self.growth_tokens else LeadBy.GROWTH

    def to_json(self) -> dict[str, Any]:
        return {"seconds": round(self.seconds, 3), "source": self.source, "why": self.why,
                "runs": self.runs,
                "p90_s": None if self.p90_s is None else round(self.p90_s, 3),
                "tokens": max(self.growth_tokens, self.step_tokens),
                "growth_tokens": self.growth_tokens, "step_tokens": self.step_tokens,
                "by": self.by}


async def lead_used(store: Store, info: SessionInfo, config: Config,
                    now: dt.datetime | None = None) -> LeadUsed:
    now = now or utcnow()
    used = await _lead_seconds_used(store, info, config, now)
    parts = lead_parts(info, session_policy(info, config), config, now)
    used = dataclasses.replace(used, growth_tokens=parts.growth, step_tokens=parts.step)
    if used.by is LeadBy.STEP:
        used = dataclasses.replace(used, why=(
            f"{used.why}; its largest recent step leads: {parts.step} tokens ahead, more than "
            f"its growth over the lead ({parts.growth}; summarization.lead_steps)"))
    return used


async def _lead_seconds_used(store: Store, info: SessionInfo, config: Config,
                             now: dt.datetime) -> LeadUsed:
    seconds = session_lead_s(info, config)
    if config.lead == 0:
        return LeadUsed(0.0, "off", "off (summarization.lead: 0): fires at its trigger")
    if info.growth_rate_at(now) <= 0:
        return LeadUsed(0.0, "no_growth", "no growth history: fires at its trigger")
    if config.lead is not None:
        return LeadUsed(seconds, "configured", f"configured: summarization.lead {seconds:g} s")
    pool = pool_of(info.run_model)
    rows = await store.read_leads([pool, ALL_POOLS])
    row = rows.get(pool) or rows.get(ALL_POOLS)
    if row is None or row.source != "auto":
        return LeadUsed(seconds, FIRST, f"auto, no run measured yet: the first lead, "
                                        f"summarization.first_lead_s {seconds:g} s")
    whose = "of its run model" if row.pool == pool else "of every pool"
    return LeadUsed(seconds, "auto",
                    f"auto from {row.runs} runs {whose}: p{round(LEAD_PERCENTILE * 100)} = "
                    f"{row.lead_s:.1f} s", runs=row.runs, p90_s=row.p90_s)
