"""Checkpoint leads: the table the append reads its session's lead from, and the run samples
the lead is measured on (``worker.lead`` decides what is written).

A pool is the sessions of one run model (their candidate chain is the same); ``ALL_POOLS`` holds
the lead of every run, which a pool without its own row takes.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from compactd.storage import schema as t
from compactd.storage.database import connection, transaction
from compactd.storage.kinds import RunStatus, Stage

if TYPE_CHECKING:
    from compactd.storage.connectors import Connector

ALL_POOLS = "*"


def pool_of(run_model: str | None) -> str:
    """The pool a session of ``run_model`` belongs to."""
    return run_model or ""


@dataclass(frozen=True, slots=True)
class LeadRow:
    """One pool's lead: the seconds its sessions fire by, and where they came from."""

    pool: str
    lead_s: float
    source: str  # auto, configured or off
    runs: int  # the runs it was measured on (auto)
    p90_s: float | None  # their percentile, None when too few
    measured_at: dt.datetime


@dataclass(frozen=True, slots=True)
class LeadSample:
    """A committed automatic run that wrote a summary: its pool and signal-to-commit seconds."""

    pool: str
    seconds: float


class LeadsMixin:
    engine: AsyncEngine
    db: Connector

    async def lead_samples(self, *, since: dt.datetime, limit: int) -> list[LeadSample]:
        """The newest ``limit`` committed or partial automatic runs finished since ``since``
        that were asked for by a signal, newest first; only those that committed a summary
        count (a prune alone is not what the lead waits for). Each is timed to its first
        checkpoint's commit, the first new surface the runtime can pick up: a later round's
        commit is not, nor a partial run's end (its failure's). A committed row without that
        time (written before runs recorded it) is timed to its end."""
        r, s = t.compaction_runs.c, t.sessions.c
        stmt = (sa.select(s.run_model, r.status, r.signalled_at, r.started_at, r.finished_at,
                          r.stages)
                .select_from(t.compaction_runs.join(t.sessions, s.id == r.session_id))
                .where(r.status.in_([RunStatus.COMMITTED, RunStatus.PARTIAL]),
                       r.signalled_at.is_not(None), r.finished_at >= since)
                .order_by(r.finished_at.desc()).limit(limit))
        async with connection(self.engine) as conn:
            rows = (await conn.execute(stmt)).all()
        samples = []
        for row in rows:
            if row.finished_at is None or Stage.SUMMARY not in _stages(row.stages):
                continue
            span = claim_to_checkpoint_s(row.status, row.stages, row.started_at,
                                         row.finished_at)
            if span is None:
                continue
            checkpoint_at = row.started_at + dt.timedelta(seconds=span)
            samples.append(LeadSample(pool_of(row.run_model), max(
                0.0, (checkpoint_at - row.signalled_at).total_seconds())))
        return samples

    async def store_leads(self, leads: Sequence[LeadRow]) -> None:
        """Replace every pool's lead with ``leads`` (pools not named lose theirs)."""
        c = t.checkpoint_leads.c
        async with transaction(self.engine) as conn:
            await conn.execute(t.checkpoint_leads.delete().where(
                c.pool.not_in([lead.pool for lead in leads])))
            for lead in leads:
                values = {"lead_s": lead.lead_s, "source": lead.source, "runs": lead.runs,
                          "p90_s": lead.p90_s, "measured_at": lead.measured_at}
                await conn.execute(self.db.insert(t.checkpoint_leads)
                                   .values(pool=lead.pool, **values)
                                   .on_conflict_do_update(index_elements=[c.pool], set_=values))

    async def read_leads(self, pools: Sequence[str]) -> dict[str, LeadRow]:
        c = t.checkpoint_leads.c
        async with connection(self.engine) as conn:
            rows = (await conn.execute(sa.select(t.checkpoint_leads)
                                       .where(c.pool.in_(list(pools))))).all()
        return {row.pool: LeadRow(row.pool, row.lead_s, row.source, row.runs, row.p90_s,
                                  row.measured_at) for row in rows}


def pool_lead() -> sa.ColumnElement[float]:
    """What an append sets ``sessions.lead_s`` to: its pool's lead, else every pool's, else 0
    (``compactd_append`` does the same on PostgreSQL). Correlated with the row it updates."""
    c, lead = t.sessions.c, t.checkpoint_leads.c
    own = (sa.select(lead.lead_s).where(lead.pool == sa.func.coalesce(c.run_model, ""))
           .scalar_subquery())
    every = sa.select(lead.lead_s).where(lead.pool == ALL_POOLS).scalar_subquery()
    return sa.type_coerce(sa.func.coalesce(own, every, 0.0), sa.Float)


def claim_to_checkpoint_s(status: str, stages: object, started_at: dt.datetime,
                          finished_at: dt.datetime) -> float | None:
    """Seconds from a run's claim to its first checkpoint's commit, the first new surface the
    runtime can pick up: the time the run recorded, else (a committed row written before runs
    recorded it) its whole length; None for a partial run that recorded none."""
    if status == RunStatus.PARTIAL:
        return checkpoint_commit_s(stages)
    recorded = stages.get("claim_to_commit_s") if isinstance(stages, dict) else None
    if isinstance(recorded, int | float):
        return float(recorded)
    return float((finished_at - started_at).total_seconds())


def checkpoint_commit_s(stages: object) -> float | None:
    """Seconds from a run's claim to its first checkpoint's commit, None when it committed none
    (a ``partial`` run's end is its failure's, not its checkpoint's)."""
    recorded = stages.get("claim_to_commit_s") if isinstance(stages, dict) else None
    if Stage.SUMMARY not in _stages(stages) or not isinstance(recorded, int | float):
        return None
    return float(recorded)


def _stages(value: object) -> list[str]:
    stages = value.get("stages") if isinstance(value, dict) else None
    return [str(s) for s in stages] if isinstance(stages, list) else []
