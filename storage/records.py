"""Plain values the store returns. No SQL here, so the policy and the CLI can import them."""

from __future__ import annotations

import datetime as dt
import math
from dataclasses import dataclass, field
from typing import Any

from compactd.storage.kinds import RunStatus


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


# The seconds a session's growth rate is weighted over: each append moves the stored rate to
# ``(rate * W + added) / (W + dt)`` (``dt``: seconds since the previous append), which is exactly
# ``added / dt`` for a session that appends the same every ``dt``, forgets a burst within a few
# W, and needs neither a division by ``dt`` (appends in the same instant) nor a history read.
# Long enough to smooth an agent's step-to-step jitter, short enough to follow a new task.
GROWTH_WINDOW_S = 120.0


def decayed_growth_rate(rate: float, seconds_since: float) -> float:
    """The stored rate as it stands ``seconds_since`` the last append: as if an empty append had
    been made now, so an idle session's rate falls off instead of keeping its last value."""
    return rate * GROWTH_WINDOW_S / (GROWTH_WINDOW_S + max(0.0, seconds_since))


# A young session's stored rate still climbs from 0: after T seconds of steady growth it holds
# about ``1 - exp(-T / W)`` of it, which a lead counted on it would undercount most for the
# sessions a compressed run (a benchmark, a fast agent) has. What the lead counts divides that
# out, by at most this factor: a session that appended its whole history at once (an ingest) is
# not read as growing at that history over an instant. The sweep's stored flag multiplies by it
# (``storage.schema.OVER_SWEEP_SQL``), so it holds every session the lead fires.
YOUNG_GROWTH_MAX_FACTOR = 5


def unbiased_growth_rate(rate: float, age_s: float) -> float:
    """``rate`` (the stored one, decayed to now) as a steady rate for a session that has been
    appending for ``age_s`` seconds."""
    if age_s <= 0:
        return rate * YOUNG_GROWTH_MAX_FACTOR
    return rate * min(float(YOUNG_GROWTH_MAX_FACTOR),
                      1.0 / -math.expm1(-age_s / GROWTH_WINDOW_S))


def next_growth_rate(rate: float, added: int, seconds_since: float) -> float:
    """The rate after an append of ``added`` tokens ``seconds_since`` the previous one (what the
    append's UPDATE computes: ``compactd_append`` on PostgreSQL, the statement
    :func:`growth_rate_after` builds on SQLite)."""
    return growth_rate_after(rate, added, max(0.0, seconds_since))


def growth_rate_after(rate: Any, added: Any, elapsed_s: Any) -> Any:
    """The growth rate's one Python form, on numbers or on SQL expressions alike (``elapsed_s``
    already clamped at 0): ``storage/sql/functions/compactd_append.sql`` is its SQL form, and
    ``tests/integration/test_pressure_contract.py`` holds the two equal."""
    return (rate * GROWTH_WINDOW_S + added) / (GROWTH_WINDOW_S + elapsed_s)


# Each append keeps the session's largest recent step (``sessions.step_tokens``): the larger of
# what it added and the previous value times this, so a step some twenty appends old counts for
# about a third of its size and one big result does not lead a session for the rest of its life.
STEP_DECAY = 0.95


def step_tokens_after(step: float, added: int, first: bool) -> float:
    """The largest recent step after an append of ``added`` tokens (``first``: the session's
    first append, which leaves it at 0: it holds whatever history a runtime or an ingest
    brought at once, not a step). ``storage/sql/functions/compactd_append_v5.sql`` and SQLite's
    append statement (``storage.connectors_general``) are its SQL forms, which
    ``tests/integration/test_pressure_contract.py`` holds equal to this."""
    return 0.0 if first else max(step * STEP_DECAY, float(added))


@dataclass(frozen=True, slots=True)
class SessionInfo:
    id: str
    tenant: str
    run_model: str | None
    context_window: int | None
    envelope: dict[str, Any] | None
    envelope_tokens: int
    policy: dict[str, Any] | None
    surface_version: int
    surface_tokens: int
    surface_messages: int
    last_seq: int
    last_position: int
    reported_input_tokens: int | None
    reported_version: int | None
    reported_output_tokens: int | None
    reported_base_tokens: int | None
    signal_at: dt.datetime | None
    lease_owner: str | None
    lease_run_id: str | None
    lease_expires_at: dt.datetime | None
    lease_fence: int
    cooldown_until: dt.datetime | None
    flagged_reason: str | None
    flagged_at: dt.datetime | None
    created_at: dt.datetime
    last_append_at: dt.datetime | None
    sweep_key: str | None = None
    sweep_tokens: int | None = None
    sweep_messages: int | None = None
    over_sweep: bool | None = None
    growth_rate: float = 0.0
    compacted_version: int | None = None
    lead_s: float = 0.0
    # The largest recent append's tokens (:data:`STEP_DECAY`): the lead counts it
    # (``worker.pressure.ahead_tokens``), so a session one step from its trigger fires now.
    step_tokens: float = 0.0
    compacted_tokens: int | None = None
    # The pressure below which the session does not fire again, valid while
    # ``compacted_version`` is ``refire_version`` (``worker.pressure.held_back``).
    refire_tokens: int | None = None
    refire_version: int | None = None
    # The counters kept by name (``storage.counters``): the sums, the sweep's floors, and
    # whether some sum reaches its floor.
    counts: dict[str, int] | None = None
    sweep_counts: dict[str, int] | None = None
    over_counts: bool = False

    def growth_rate_at(self, now: dt.datetime) -> float:
        """Tokens per second the session is growing by (see :data:`GROWTH_WINDOW_S`)."""
        since = self.last_append_at or self.created_at
        return decayed_growth_rate(self.growth_rate, (now - since).total_seconds())

    def growth_at(self, now: dt.datetime) -> float:
        """The growth rate the lead counts: :meth:`growth_rate_at`, unbiased for a young
        session (:func:`unbiased_growth_rate`)."""
        last = self.last_append_at or self.created_at
        return unbiased_growth_rate(self.growth_rate_at(now),
                                    (last - self.created_at).total_seconds())

    def compacted_since(self, version: int) -> bool:
        """Whether a commit replaced part of the surface after ``version`` (appends do not
        count: they leave what a request built on ``version`` held in place)."""
        return self.compacted_version is not None and self.compacted_version > version

    def lease_live(self, now: dt.datetime) -> bool:
        return self.lease_expires_at is not None and self.lease_expires_at > now

    def signal_live(self, now: dt.datetime, ttl_s: float) -> bool:
        """Whether the pending-signal mark is younger than ``ttl_s``: one ``mark_signal``
        would leave in place, so a run is already asked for."""
        return self.signal_at is not None and self.signal_at > now - dt.timedelta(seconds=ttl_s)

    @property
    def reported_tokens(self) -> int | None:
        """The provider's measure of the runtime's next request: the reported call's input and
        output (the response is part of the next request), plus whatever the surface and
        envelope gained after the response. None when no report stands (a compaction that
        replaced part of the surface clears it)."""
        if self.reported_input_tokens is None:
            return None
        measured = self.surface_tokens + self.envelope_tokens
        base = measured if self.reported_base_tokens is None else self.reported_base_tokens
        return (self.reported_input_tokens + (self.reported_output_tokens or 0)
                + max(0, measured - base))


@dataclass(frozen=True, slots=True)
class AppendResult:
    session: SessionInfo
    first_seq: int
    last_seq: int
    tokens: tuple[int, ...]
    signalled: bool = False
    # Answered from the append made earlier with the same idempotency key: nothing was stored,
    # and ``session`` holds the version and totals that append returned.
    replayed: bool = False

    @property
    def version(self) -> int:
        return self.session.surface_version


# How long an append's idempotency key answers for the append made with it, by default
# (``retention.append_keys_hours``): longer than any retry of a step takes.
APPEND_KEY_WINDOW_S = 24 * 3600.0


@dataclass(frozen=True, slots=True)
class AppendKey:
    """An append's idempotency key, the digest of its batch, and the time before which a row
    stored under the key has expired."""

    key: str
    request_sha256: str
    live_after: dt.datetime


@dataclass(frozen=True, slots=True)
class EventRecord:
    seq: int
    kind: str
    payload: dict[str, Any]
    tokens: int | None
    run_id: str | None
    created_at: dt.datetime


@dataclass(frozen=True, slots=True)
class AppendedMessage:
    """A message as the runtime appended it: its seq, the append's time (every message of one
    append has it) and its tokens then."""

    seq: int
    at: dt.datetime
    tokens: int


@dataclass(frozen=True, slots=True)
class VerifyResult:
    session_id: str
    ok: bool
    problems: tuple[str, ...] = ()
    nodes: int = 0
    tokens: int = 0


@dataclass(frozen=True, slots=True)
class Claim:
    """A lease taken on a session: the run row exists and ``compaction/start`` is journaled."""

    session: SessionInfo
    run_id: str
    fence: int
    owner: str
    expires_at: dt.datetime


@dataclass(frozen=True, slots=True)
class Busy:
    """The session was leased by someone else; a ``busy`` run row records the attempt."""

    run_id: str
    holder: str | None
    expires_at: dt.datetime | None


@dataclass(frozen=True, slots=True)
class Skipped:
    """Nothing was claimed: the work was already done (a bulk item delivered twice)."""

    reason: str


@dataclass(frozen=True, slots=True)
class Replacement:
    """Replace the contiguous surface run ``seqs`` with one node, at the run's first position.

    ``journal`` is written just before the node (``compaction/prune`` or ``compaction/summary``).
    A commit applies its replacements in order, each to the surface the one before it left.
    Placements (see :mod:`storage.surface`): ``before`` puts the node directly before that node,
    which must directly precede the run (the two swap places); ``after``, with ``seqs`` empty,
    inserts it into the free position directly after that node. Either names a node on the
    surface or a seq an earlier replacement of the same commit replaced (its new node).
    ``keeps``: nodes inside the run that stay where they are (the run is ``seqs`` and
    ``keeps`` together); the node then takes the first position after the last of them.
    """

    seqs: tuple[int, ...]
    kind: str
    payload: dict[str, Any]
    tokens: int
    journal_kind: str
    journal: dict[str, Any] = field(default_factory=dict)
    before: int | None = None
    after: int | None = None
    keeps: tuple[int, ...] = ()

    @property
    def placed(self) -> bool:
        return self.before is not None or self.after is not None


@dataclass(frozen=True, slots=True)
class RunEnd:
    """How a claimed run ends; written with ``compaction/end`` as the last entry."""

    outcome: str
    failure_class: str | None = None
    error: str | None = None
    tokens_before: int | None = None
    tokens_after: int | None = None
    model: str | None = None
    usage: dict[str, Any] | None = None
    candidates: list[dict[str, Any]] | None = None
    stages: dict[str, Any] | None = None
    range_seqs: list[int] | None = None
    signalled_at: dt.datetime | None = None
    # The run's instructions, journaled with its end (the run row holds them from the claim).
    instructions: tuple[str, ...] = ()
    # What the pre-compaction hook answered or how it failed (worker.hooks), journaled.
    hook: dict[str, Any] | None = None
    # A run that left its session over its trigger with nothing a run could do yet: the
    # pressure below which the session does not fire again, and the ``compacted_version`` the
    # run saw (written on the session row with the run's end).
    refire: tuple[int, int | None] | None = None


@dataclass(frozen=True, slots=True)
class RunRecord:
    id: str
    session_id: str
    trigger: str
    status: str
    failure_class: str | None
    owner: str | None
    fence: int | None
    task_id: str | None
    bulk_job_id: str | None
    surface_version_at_start: int | None
    range_seqs: list[int] | None
    candidates: list[dict[str, Any]] | None
    stages: dict[str, Any] | None
    model: str | None
    usage: dict[str, Any] | None
    tokens_before: int | None
    tokens_after: int | None
    error: str | None
    started_at: dt.datetime
    heartbeat_at: dt.datetime | None
    finished_at: dt.datetime | None
    signalled_at: dt.datetime | None = None
    instructions: list[str] | None = None

    @property
    def finished(self) -> bool:
        return self.status != RunStatus.RUNNING

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name in self.__slots__:
            value = getattr(self, name)
            out[name] = value.isoformat() if isinstance(value, dt.datetime) else value
        return out


@dataclass(frozen=True, slots=True)
class ReapedLease:
    session_id: str
    run_id: str | None
    owner: str | None
    expired_at: dt.datetime | None


@dataclass(frozen=True, slots=True)
class BulkJob:
    id: str
    filter: dict[str, Any]
    state: str
    force: bool
    rate_per_s: float | None
    matched: int
    created_at: dt.datetime
    updated_at: dt.datetime
    pending: int = 0
    enqueued: int = 0
    done: int = 0  # compacted
    skipped: int = 0  # nothing to do (under its trigger without --force)
    failed: int = 0

    @property
    def ended(self) -> int:
        return self.done + self.skipped + self.failed

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "filter": self.filter, "state": self.state, "force": self.force,
                "rate_per_s": self.rate_per_s, "matched": self.matched,
                "pending": self.pending, "enqueued": self.enqueued, "done": self.done,
                "skipped": self.skipped, "failed": self.failed,
                "created_at": self.created_at.isoformat(),
                "updated_at": self.updated_at.isoformat()}
