"""One run's scope, from its claim to its end.

A :class:`RunScope` owns what every compaction run has, whatever its pipeline does:

* the claim (``compaction/start`` is written first, in the claim's transaction) and the end
  (``compaction/end`` written last: in the transaction of the final checkpoint, or by
  :meth:`RunScope.end`, or for a failed run by the scope itself within its own grace);
* the lease, renewed every third of its length while the run works and stopped before the
  ending commit (that commit clears the lease; a renewal after it would find the fence gone);
* the deadline (``worker.deadline_s`` from the claim): statements end at it on the server, the
  loop's own timeout a moment later ends whatever else still waits, and the remote models stop
  a reserve earlier so the local fallback and the commit fit;
* cancellation: a lost lease, the deadline, a worker shutdown or a revoked task each end the run
  in its failure class (``abandoned``, ``cancelled``), recorded before it propagates;
* the :class:`Outcome`, with the usage the providers billed, added up per model call.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from compactd.storage.database import deadline
from compactd.storage.deletion import DELETED_ERROR, DELETER
from compactd.storage.errors import (
    DatabaseUnavailable,
    DeadlinePassed,
    LeaseLost,
    SessionNotFound,
    StorageError,
    SurfaceChanged,
)
from compactd.storage.kinds import (
    FailureClass,
    JournalKind,
    NodeKind,
    RunCause,
    RunStatus,
    Stage,
)
from compactd.storage.leases import REAPER
from compactd.storage.records import Busy, Claim, Replacement, RunEnd, SessionInfo, Skipped
from compactd.worker import logs
from compactd.worker.cost import USAGE_KINDS, Billed, cost_parts
from compactd.worker.keys import RATE_PROVIDER, bulk_meter
from compactd.worker.limits import MeteredProviders
from compactd.worker.llm.pool import ProviderPool
from compactd.worker.metrics import metrics
from compactd.worker.runtime import Deps

logger = logging.getLogger(__name__)

# Triggers whose run answers a pressure signal: its end clears the session's signal mark.
AUTOMATIC_TRIGGERS = (RunCause.PRESSURE, RunCause.SWEEP, RunCause.REAP)
# Triggers whose run compacts under the session's trigger: someone asked for it, or the new
# run model's window needs it (set_run_model, which is not the agent's request: its own cause).
MANUAL_TRIGGERS = (RunCause.MANUAL, RunCause.WINDOW)
# How long after its deadline the loop cancels a run still waiting on something the deadline
# does not reach by itself (the statements it does end on the server, cleanly, first).
DEADLINE_OVERRUN_S = 1.0
# A run that ends failed (past its deadline too) still writes its end and releases its lease,
# within this long; at most half of what is left between the deadline and the task's limit.
FINISH_GRACE_S = 10.0
T = TypeVar("T")
# Between two attempts to end a run while the database cannot be reached.
UNAVAILABLE_PAUSE_S = 0.25
# Between two attempts to end the runs whose end the database could not take.
UNENDED_RETRY_S = 0.5
# What one of those attempts may wait on the database (a lock, a statement) before it fails and
# the next run's is made: none waits on another's.
UNENDED_ATTEMPT_S = 5.0
# The part of a run's deadline the remote models never get (at most a tenth of it): the local
# fallback writes its summary and the checkpoint is committed in it.
COMMIT_RESERVE_S = 10.0


@dataclass
class Outcome:
    session: str
    run_id: str | None
    outcome: RunStatus  # committed, nothing_to_do, failed or partial
    failure_class: FailureClass | None = None
    trigger: str = RunCause.PRESSURE
    tokens_before: int | None = None
    tokens_after: int | None = None
    pruned: int = 0
    replaced_seqs: list[int] = field(default_factory=list)
    model: str | None = None
    stages: list[str] = field(default_factory=list)
    candidates: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None
    summary: str | None = None
    rounds: int = 0
    rate_wait_s: float = 0.0  # how long the model calls waited on the shared rate meters
    ended: bool = False  # the run's end is committed (run row and compaction/end written)
    # Tokens the providers billed for the run's model calls: totals and per candidate.
    usage: dict[str, Any] | None = None
    # Who released the run's lease (``compactd lease release --by``), when an operator ended it.
    released_by: str | None = None
    # When the pressure signal an automatic run answers was marked (the lead is measured from
    # it to the checkpoint's commit: ``worker.lead``); None for other runs.
    signalled_at: dt.datetime | None = None
    # What the run expected the agent to append before the pickup (keep_at: pickup), when it
    # kept less by it.
    arrivals: dict[str, Any] | None = None
    # Seconds from the claim to the run's first checkpoint commit.
    claim_to_commit_s: float | None = None
    # What a manual run was asked to focus on (storage.instructions).
    instructions: tuple[str, ...] = ()
    # The pre-compaction hook's answer or failure (worker.hooks), for the journal.
    hook: dict[str, Any] | None = None
    # An automatic run that left its session over its trigger with nothing worth a run yet:
    # the pressure below which it does not fire again and the compacted_version it saw.
    refire: tuple[int, int | None] | None = None

    @property
    def failed(self) -> bool:
        return self.outcome == RunStatus.FAILED

    @property
    def checkpoint_committed(self) -> bool:
        """Whether one of the run's commits was a checkpoint: a committed run's summary round,
        or a partial run's round before it failed (the agent has it either way)."""
        return self.outcome in (RunStatus.COMMITTED, RunStatus.PARTIAL) \
            and Stage.SUMMARY in self.stages

    @property
    def replaced_nodes(self) -> bool:
        """Whether one of the run's commits replaced nodes: a run that failed in a later round
        keeps what its earlier rounds committed."""
        return (self.outcome == RunStatus.COMMITTED or bool(self.replaced_seqs)
                or self.pruned > 0)

    def fail(self, failure_class: FailureClass, error: str) -> None:
        """End as failed with ``failure_class``; as ``partial`` when some of the run's steps
        committed before (the session did shrink: a failed status alone would hide that)."""
        self.failure_class = failure_class
        committed = committed_steps(self.stages.count(Stage.SUMMARY), self.pruned)
        if committed:
            self.outcome = RunStatus.PARTIAL
            self.error = f"committed {committed}, then failed: {error}"
        else:
            self.outcome = RunStatus.FAILED
            self.error = error

    def to_json(self) -> dict[str, Any]:
        return {"session": self.session, "run_id": self.run_id, "outcome": self.outcome,
                "failure_class": self.failure_class, "tokens_before": self.tokens_before,
                "tokens_after": self.tokens_after, "pruned": self.pruned,
                "replaced_seqs": self.replaced_seqs, "model": self.model,
                "stages": self.stages, "rounds": self.rounds, "trigger": self.trigger,
                "rate_wait_s": round(self.rate_wait_s, 3), "usage": self.usage,
                "error": self.error, "candidates": self.candidates, "arrivals": self.arrivals,
                "instructions": list(self.instructions)}

    def brief(self) -> dict[str, Any]:
        """The outcome at a glance, which the Celery task returns (Flower's result column).
        The replaced seqs and the candidates' attempts stay in the run row: Celery renders
        a task's return value for its log line and its event, on every compaction."""
        brief = {"session": self.session, "run_id": self.run_id, "outcome": self.outcome,
                 "failure_class": self.failure_class, "trigger": self.trigger,
                 "tokens_before": self.tokens_before, "tokens_after": self.tokens_after,
                 "stages": self.stages, "model": self.model, "error": self.error}
        if self.released_by is not None:
            brief["released_by"] = self.released_by
        return brief

    def run_end(self) -> RunEnd:
        return RunEnd(outcome=self.outcome, failure_class=self.failure_class, error=self.error,
                      tokens_before=self.tokens_before, tokens_after=self.tokens_after,
                      model=self.model, usage=self.usage, candidates=self.candidates or None,
                      stages={"stages": self.stages, "pruned": self.pruned,
                              "rounds": self.rounds,
                              "rate_wait_s": round(self.rate_wait_s, 3),
                              **({"arrivals": self.arrivals} if self.arrivals else {}),
                              **({"claim_to_commit_s": round(self.claim_to_commit_s, 3)}
                                 if self.claim_to_commit_s is not None else {})},
                      range_seqs=self.replaced_seqs or None, signalled_at=self.signalled_at,
                      instructions=self.instructions, hook=self.hook, refire=self.refire)


def committed_steps(checkpoints: int, prunes: int) -> str:
    """What a run committed, in words ("" for nothing): its rounds that committed a summary
    (a checkpoint, or a recallable pass's index checkpoints) and its prunes."""
    parts = [f"{n} {what}{'s' if n != 1 else ''}"
             for n, what in ((checkpoints, "summary round"), (prunes, "prune")) if n]
    return " and ".join(parts)


class RunFailed(Exception):
    def __init__(self, failure_class: FailureClass, error: str) -> None:
        super().__init__(error)
        self.failure_class = failure_class
        self.error = error


async def _while_unavailable(call: Callable[[], Awaitable[T]], *, until: float) -> T:
    """``call()``, made again while the database is unavailable (a primary failing over, the
    pool's connections lost with it) until the loop's time ``until``: a run's end written on
    the new primary releases its lease now, where the reaper would wait for it to expire."""
    loop = asyncio.get_running_loop()
    while True:
        try:
            return await call()
        except DatabaseUnavailable:
            if loop.time() + UNAVAILABLE_PAUSE_S >= until:
                raise
            await asyncio.sleep(UNAVAILABLE_PAUSE_S)


def failure_of(exc: BaseException, *, past_deadline: bool, deadline_s: float
               ) -> tuple[FailureClass, str]:
    """The failure class and error of a run that ended with ``exc``. Once the deadline has
    passed, a failed write (a lock wait or a statement the deadline ended) is the deadline's
    doing: ``cancelled``."""
    passed = f"the run passed its deadline ({deadline_s:g} s)"
    if isinstance(exc, SessionNotFound):
        # Deleted under the run (`compactd delete`): the commit found no session.
        return FailureClass.CANCELLED, DELETED_ERROR
    if isinstance(exc, TimeoutError | DeadlinePassed):
        return FailureClass.CANCELLED, passed
    if isinstance(exc, LeaseLost):
        return FailureClass.ABANDONED, str(exc)
    if isinstance(exc, SurfaceChanged):
        return FailureClass.CHANGED, str(exc)
    if isinstance(exc, RunFailed):
        if past_deadline and exc.failure_class == FailureClass.COMMIT:
            return FailureClass.CANCELLED, f"{passed}: {exc.error}"
        return exc.failure_class, exc.error
    # A storage error before anything was committed is a persistence failure; the commit
    # steps raise their own (RunFailed "commit").
    if past_deadline:
        return FailureClass.CANCELLED, f"{passed}: {exc}"
    return FailureClass.PERSISTENCE, str(exc)


class RunScope:
    """One claimed run: its lease, deadline, outcome and end. Made by :meth:`open` (the claim); the
    pipeline runs inside :meth:`run` and writes through :meth:`commit` and :meth:`end`."""

    def __init__(self, deps: Deps, claim: Claim, *, trigger: str, deadline_at: float,
                 bulk_job_id: str | None = None, rate_per_s: float | None = None) -> None:
        self.deps = deps
        self.claim = claim
        self.deadline_at = deadline_at
        self.bulk_job_id = bulk_job_id
        self.rate_per_s = rate_per_s
        self.out = Outcome(claim.session.id, claim.run_id, RunStatus.NOTHING_TO_DO,
                           trigger=trigger,
                           signalled_at=(claim.session.signal_at
                                         if trigger in AUTOMATIC_TRIGGERS else None))
        self._lease: _KeptLease | None = None
        self.claimed_at: Any = None  # the clock's time the claim was made at

    @classmethod
    async def open(cls, deps: Deps, session_id: str, *, trigger: str,
                    task_id: str | None = None, bulk_job_id: str | None = None,
                    rate_per_s: float | None = None) -> RunScope | Outcome:
        """The scope of a new run of ``session_id``, or the outcome of a run that could not
        start (nothing to do, or ``busy``: another run holds the lease)."""
        deadline_at = asyncio.get_running_loop().time() + deps.config.worker.deadline_s
        with deadline(deadline_at):
            if deps.unended is not None:
                # This process's own run of the session that could not end holds its lease:
                # ended first, or this claim would find the session busy until it expires.
                await deps.unended.end(session_id)
            claimed_at = deps.clock()
            claim = await deps.store.claim(session_id, owner=deps.owner, trigger=trigger,
                                           lease_s=deps.config.worker.lease_s,
                                           now=claimed_at, task_id=task_id,
                                           bulk_job_id=bulk_job_id)
        if isinstance(claim, Skipped):
            return _counted(Outcome(session_id, None, RunStatus.NOTHING_TO_DO, trigger=trigger,
                                    error=claim.reason))
        if isinstance(claim, Busy):
            return _counted(Outcome(session_id, claim.run_id, RunStatus.FAILED, FailureClass.BUSY,
                                    trigger=trigger,
                                    error=f"leased by {claim.holder}"))
        scope = cls(deps, claim, trigger=trigger, deadline_at=deadline_at,
                    bulk_job_id=bulk_job_id, rate_per_s=rate_per_s)
        scope.claimed_at = claimed_at
        return scope

    async def run(self, pipeline: Callable[[], Awaitable[None]]) -> Outcome:
        """Run ``pipeline`` under the lease and the deadline, and end the run: whatever way it
        ends becomes the outcome; never raises for a failed run (a cancellation is recorded,
        then let through)."""
        deps, out = self.deps, self.out
        loop = asyncio.get_running_loop()
        metrics().in_flight.inc()
        with logs.bind(session_id=out.session, run_id=out.run_id):
            try:
                # Statements end at the deadline on the server (storage.database.deadline); the
                # loop's own timeout, a moment later, ends whatever else still waits.
                with deadline(self.deadline_at):
                    async with asyncio.timeout_at(self.deadline_at + DEADLINE_OVERRUN_S), \
                            _kept_lease(deps, self.claim) as lease:
                        self._lease = lease
                        try:
                            await pipeline()
                        except asyncio.CancelledError:
                            if not lease.lost.is_set():
                                raise
                            current = asyncio.current_task()
                            if current is not None:
                                current.uncancel()
                            raise LeaseLost("the lease could not be renewed") from None
            except asyncio.CancelledError:
                # Worker shutdown, a revoked task or the task's time limit: record it, then let
                # the cancellation through.
                if not out.ended:
                    out.fail(FailureClass.CANCELLED, "the run was cancelled before it committed")
                    with contextlib.suppress(Exception):
                        await asyncio.shield(self._end_failed())
                raise
            except (TimeoutError, StorageError, RunFailed, SessionNotFound) as exc:
                if out.ended:
                    # The run's end is committed: what failed after it (the loop guard's
                    # bookkeeping) does not make it a failed run.
                    logger.warning("after the run ended: %s", type(exc).__name__,
                                   extra={"action": "compaction.after_end"})
                else:
                    out.fail(*failure_of(exc, past_deadline=loop.time() >= self.deadline_at,
                                         deadline_s=deps.config.worker.deadline_s))
                    await self._end_failed_quietly()
            finally:
                metrics().in_flight.dec()
            signalled_at = self.claim.session.signal_at
            checkpoint_at = self._checkpoint_at()
            if checkpoint_at is not None and out.trigger in AUTOMATIC_TRIGGERS and signalled_at:
                # The wait an agent under pressure has for its checkpoint: the alert on the
                # runway (ops/prometheus/alerts.yaml) compares its p99 with the least runway.
                metrics().pressure_to_checkpoint.labels(out.trigger).observe(
                    max(0.0, (checkpoint_at - signalled_at).total_seconds()))
            logger.info("compaction %s%s", out.outcome,
                        f" ({out.failure_class})" if out.failure_class else "",
                        extra={"action": "compaction.end", "outcome": out.outcome,
                               "failure_class": out.failure_class, "trigger": out.trigger,
                               "tokens_before": out.tokens_before,
                               "tokens_after": out.tokens_after, "stages": out.stages,
                               "model": out.model})
        return _counted(out)

    # ---------------------------------------------------------------------------- writing

    def _checkpoint_at(self) -> Any:
        """When the agent could first pick a checkpoint of the run up: its first checkpoint's
        commit, whatever the run did after it (later rounds, a failure: a partial run's end is
        its failure's); None for a run that committed none. As ``store.lead_samples`` times
        it, so the metric and the lead measure one wait."""
        out = self.out
        if not out.checkpoint_committed:
            return None
        if out.claim_to_commit_s is not None and self.claimed_at is not None:
            return self.claimed_at + dt.timedelta(seconds=out.claim_to_commit_s)
        return self.deps.clock() if out.outcome == RunStatus.COMMITTED else None

    async def commit(self, replacements: Sequence[Replacement], *, what: str,
                     expected: Sequence[tuple[int, int]] | None = None,
                     final: bool = False) -> SessionInfo:
        """Commit ``replacements`` under the lease (the fence must still be ours). ``final``:
        the run's end (the outcome as it stands) goes in the same transaction, written last,
        and the lease stops renewing first. A failed commit is ``commit`` failure of ``what``,
        unless the lease, the surface or the deadline is what refused it."""
        end = None
        if self.out.claim_to_commit_s is None and self.claimed_at is not None and any(
                r.kind == NodeKind.CHECKPOINT for r in replacements):
            # What the agent waits for from the claim to a checkpoint it can pick up: a later
            # round's commit is not, nor a prune's (keep_at: pickup expects it of new runs).
            self.out.claim_to_commit_s = max(
                0.0, (self.deps.clock() - self.claimed_at).total_seconds())
        if final:
            end = self.out.run_end()
            await self._kept().stop()
        try:
            info = await self.deps.store.commit(
                self.claim.session.id, run_id=self.claim.run_id, fence=self.claim.fence,
                replacements=replacements, expected=expected, end=end, now=self.deps.clock())
        except (LeaseLost, SurfaceChanged, DeadlinePassed):
            raise
        except StorageError as exc:
            raise RunFailed(FailureClass.COMMIT, f"committing {what} failed: {exc}") from exc
        if final:
            self.out.ended = True
        return info

    async def end(self) -> None:
        """End a run whose last step committed without its end: stop the lease, then write the
        run row and ``compaction/end``, clearing the lease."""
        await self._kept().stop()
        if not await self.deps.store.finish(self.claim.session.id, run_id=self.claim.run_id,
                                            fence=self.claim.fence, end=self.out.run_end(),
                                            now=self.deps.clock()):
            raise LeaseLost("the lease was lost before the run ended")
        self.out.ended = True

    async def _end_failed(self) -> None:
        """Write the end of a failed run and release its lease, within its own grace (the run's
        deadline may be what ended it). If the lease is gone, the run row says what became of
        the run: a commit that landed although its answer did not arrive (a deadline cancelled
        the wait) makes the outcome committed after all."""
        deps, out, claim = self.deps, self.out, self.claim
        worker = deps.config.worker
        grace_s = min(FINISH_GRACE_S, (worker.task_time_limit_s - worker.deadline_s) / 2)
        until = asyncio.get_running_loop().time() + grace_s
        with deadline(until):
            if await _while_unavailable(lambda: deps.store.finish(
                    claim.session.id, run_id=claim.run_id, fence=claim.fence,
                    end=out.run_end(), now=deps.clock()), until=until):
                return
            run = await deps.store.get_run(claim.run_id)
            if (run is not None and run.failure_class == FailureClass.ABANDONED
                    and out.failure_class == FailureClass.ABANDONED):
                out.error = run.error
                out.released_by = await self._released_by()
            if run is None or run.failure_class == FailureClass.CANCELLED:
                # A deletion of the session took the lease and ended the run, or has deleted
                # its row already (storage.deletion): the run ended as asked.
                out.fail(FailureClass.CANCELLED, DELETED_ERROR)
                out.released_by = DELETER
        if run is not None and run.status == RunStatus.COMMITTED:
            out.outcome, out.failure_class, out.error = RunStatus.COMMITTED, None, None
            out.ended = True
            out.tokens_after = run.tokens_after

    async def _released_by(self) -> str | None:
        """Who ended this run by releasing its lease, from its ``compaction/end``; None when the
        reaper ended it (the lease expired: the holder stalled, which is a fault)."""
        ends = await self.deps.store.read_events(self.claim.session.id, kinds=[JournalKind.END],
                                                 after_seq=self.claim.session.last_seq)
        for event in ends:
            closed_by = (event.payload or {}).get("closed_by")
            if event.run_id == self.claim.run_id and closed_by != REAPER:
                return str(closed_by)
        return None

    async def _end_failed_quietly(self) -> None:
        """End the run's journal; if even that fails, the lease expires and the reaper ends it."""
        try:
            await self._end_failed()
        except SessionNotFound:
            # Deleted under the run: nothing of it is left to end.
            self.out.fail(FailureClass.CANCELLED, DELETED_ERROR)
            self.out.released_by = DELETER
        except StorageError as exc:
            logger.warning("could not record the end of a failed run; it is ended once the "
                           "database answers again",
                           extra={"action": "compaction.finish_failed", "error": str(exc)})
            if self.deps.unended is None:
                self.deps.unended = UnendedRuns(self.deps)
            self.deps.unended.add(self.claim, self.out.run_end())

    def _kept(self) -> _KeptLease:
        assert self._lease is not None, "the lease is kept only inside RunScope.run"
        return self._lease

    # ---------------------------------------------------------------------- model calls

    def models_left_s(self) -> float:
        """What the remote models have left: the run's deadline less the commit's reserve."""
        reserve_s = min(COMMIT_RESERVE_S, self.deps.config.worker.deadline_s / 10)
        return max(0.0, self.deadline_at - reserve_s - asyncio.get_running_loop().time())

    def providers(self) -> Any:
        """The process's provider pool, behind the global and bulk-job rate meters; the time
        the calls wait on the meters is added to the outcome."""
        deps = self.deps
        worker = deps.config.worker
        if deps.models is None:
            deps.models = ProviderPool.from_config(worker)
        meters: list[tuple[str, float]] = []
        if worker.provider_rate_per_s:
            meters.append((RATE_PROVIDER, worker.provider_rate_per_s))
        if self.rate_per_s:
            meters.append((bulk_meter(self.bulk_job_id or "adhoc"), self.rate_per_s))
        if not meters:
            return deps.models
        return MeteredProviders(deps.models, deps.limiter, meters, on_wait=self._waited)

    def _waited(self, seconds: float) -> None:
        self.out.rate_wait_s += seconds

    def record_call(self, attempts: Sequence[Any], step_usage: dict[str, Any] | None = None
                    ) -> dict[str, Any] | None:
        """Record one summarizer call's ``attempts``: the candidates tried, their latency and
        failures, and what the providers billed (every attempt that got an answer, refused ones
        too) added to the run's usage and to ``step_usage``, which is returned."""
        self.out.candidates.extend(a.to_json() for a in attempts)
        m = metrics()
        for a in attempts:
            m.model_latency.labels(a.candidate).observe(a.latency_s)
            if a.kind is not None:
                m.model_failures.labels(a.candidate, a.kind).inc()
        for attempt in attempts:
            reported = attempt.usage.to_json() if attempt.usage is not None else {}
            if all(reported.get(kind) is None for kind in USAGE_KINDS):
                continue  # no answer, or the local summarizer (no call)
            tokens = {kind: int(reported.get(kind) or 0) for kind in USAGE_KINDS}
            step_usage = _add_usage(step_usage, attempt.candidate, tokens)
            self.out.usage = _add_usage(self.out.usage, attempt.candidate, tokens)
            for kind, value in tokens.items():
                m.model_tokens.labels(attempt.candidate, kind.removesuffix("_tokens")).inc(value)
            price = self.deps.config.prices.get(attempt.candidate)
            if price is not None:
                for part, usd in cost_parts(Billed.of(tokens), price).items():
                    m.cost_usd.labels(attempt.candidate, part).inc(usd)
        return step_usage


class UnendedRuns:
    """This process's failed runs whose end could not be written (a failover slower than the
    run's grace, the run's own connection lost). Their leases would hold until they expire
    (``worker.lease_s``, then the reaper): each is ended instead as soon as the database answers
    again, by a retry every ``retry_s``, and before this process claims its session again. The
    end is fenced (:meth:`Store.finish`): a lease that moved on is left to its new holder, and a
    run whose commit landed after all keeps its end. Each attempt waits on the database (a lock,
    a statement) at most ``attempt_s``, so a session whose row stays locked holds no other's.
    Past the lease's length the reaper's expiry ends it anyway, and the retries stop."""

    def __init__(self, deps: Deps, *, retry_s: float = UNENDED_RETRY_S,
                 attempt_s: float = UNENDED_ATTEMPT_S) -> None:
        self._deps = deps
        self._retry_s = retry_s
        self._attempt_s = attempt_s
        # by session: its claim, the end to write, the loop time the lease is expired by
        self._runs: dict[str, tuple[Claim, RunEnd, float]] = {}
        # by session: the last error its end's write failed with, logged once until it changes
        self._failed_with: dict[str, str] = {}
        self._task: asyncio.Task[None] | None = None

    def add(self, claim: Claim, end: RunEnd) -> None:
        expired_by = asyncio.get_running_loop().time() + self._deps.config.worker.lease_s
        self._runs[claim.session.id] = (claim, end, expired_by)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._retry())

    async def end(self, session_id: str) -> None:
        """End ``session_id``'s unended run now, if this process has one.
        :class:`DatabaseUnavailable` when the database still cannot be reached."""
        if session_id in self._runs:
            await self._end(*self._runs[session_id][:2])

    async def _end(self, claim: Claim, end: RunEnd) -> None:
        deps = self._deps
        ours = await deps.store.finish(claim.session.id, run_id=claim.run_id, fence=claim.fence,
                                       end=end, now=deps.clock())
        if self._runs.get(claim.session.id, (None,))[0] is claim:
            self._drop(claim.session.id)
        logger.info("the end of a run the database could not take is written%s",
                    "" if ours else " (its lease had moved on)",
                    extra={"action": "compaction.unended_ended", "session_id": claim.session.id,
                           "run_id": claim.run_id, "lease_released": ours})

    async def _retry(self) -> None:
        loop = asyncio.get_running_loop()
        while self._runs:
            await asyncio.sleep(self._retry_s)
            for claim, end, expired_by in list(self._runs.values()):
                if loop.time() >= expired_by:
                    self._drop(claim.session.id)
                    continue
                try:
                    with deadline(loop.time() + self._attempt_s):
                        await self._end(claim, end)
                except DatabaseUnavailable:
                    break  # still unreachable: every run waits for the next attempt
                except SessionNotFound:
                    self._drop(claim.session.id)  # deleted: nothing left to end
                except StorageError as exc:
                    # Retried still (a lock held, a schema migrated meanwhile: the lease's
                    # expiry bounds it), but logged once, and again only when it changes.
                    failure = f"{type(exc).__name__}: {exc}"
                    if self._failed_with.get(claim.session.id) != failure:
                        self._failed_with[claim.session.id] = failure
                        logger.warning("ending a run the database could not take failed: %s "
                                       "(retried every %.1f s until its lease expires)",
                                       exc, self._retry_s,
                                       extra={"action": "compaction.unended_failed",
                                              "session_id": claim.session.id,
                                              "run_id": claim.run_id})

    def _drop(self, session_id: str) -> None:
        self._runs.pop(session_id, None)
        self._failed_with.pop(session_id, None)

    async def aclose(self) -> None:
        """Stop retrying; what is left the reaper ends when the leases expire."""
        self._runs.clear()
        self._failed_with.clear()
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait([self._task])


def _add_usage(total: dict[str, Any] | None, candidate: str, tokens: dict[str, int]
               ) -> dict[str, Any]:
    """``total`` with one more call's tokens, overall and under its candidate."""
    total = total or {"calls": 0, **dict.fromkeys(USAGE_KINDS, 0), "by_candidate": {}}
    mine = total["by_candidate"].setdefault(candidate,
                                            {"calls": 0, **dict.fromkeys(USAGE_KINDS, 0)})
    for counts in (total, mine):
        counts["calls"] += 1
        for kind, value in tokens.items():
            counts[kind] += value
    return total


def _counted(out: Outcome) -> Outcome:
    metrics().compactions.labels(out.outcome, out.failure_class or "", out.trigger).inc()
    if out.tokens_before is not None:
        metrics().tokens_before.observe(out.tokens_before)
    if out.outcome in (RunStatus.COMMITTED, RunStatus.PARTIAL) and out.tokens_after is not None:
        metrics().tokens_after.observe(out.tokens_after)
    return out


class _KeptLease:
    """The renewer of one run's lease. :meth:`stop` ends it before the run's ending commit:
    that commit clears the lease, and a renewal after it would find the fence gone and cancel
    a run that has already committed."""

    def __init__(self, deps: Deps, claim: Claim) -> None:
        self.lost = asyncio.Event()
        self._stopped = False
        self._renewing = False
        self._body = asyncio.current_task()
        self._task = asyncio.create_task(self._renew(deps, claim, deps.config.worker.lease_s))

    async def _renew(self, deps: Deps, claim: Claim, lease_s: float) -> None:
        while not self._stopped:
            await asyncio.sleep(lease_s / 3)
            if self._stopped:
                return
            self._renewing = True
            try:
                ok = await deps.store.renew(claim.session.id, run_id=claim.run_id,
                                            fence=claim.fence, lease_s=lease_s, now=deps.clock())
            except StorageError:
                continue  # transient; the next renewal, or the expiry, decides
            finally:
                self._renewing = False
            if not ok and not self._stopped:
                # Lost to someone else: the body's model calls are wasted work now.
                self.lost.set()
                if self._body is not None:
                    self._body.cancel()
                return

    async def stop(self) -> None:
        """No renewal after this returns. One in flight is let finish (cancelling it would
        break its transaction's connection); its answer no longer cancels the body, and the
        commit that follows checks the fence itself."""
        if self._stopped:
            return
        self._stopped = True
        if not self._renewing:
            self._task.cancel()
        # wait(), not await: the renewer's own end is no error here, and a cancellation of
        # the body while it waits must still reach the body.
        await asyncio.wait([self._task])


@contextlib.asynccontextmanager
async def _kept_lease(deps: Deps, claim: Claim) -> AsyncIterator[_KeptLease]:
    """Renew the lease every third of its length while the body runs; if a renewal finds the
    fence moved, cancel the body and set ``lost``."""
    lease = _KeptLease(deps, claim)
    try:
        yield lease
    finally:
        await lease.stop()
